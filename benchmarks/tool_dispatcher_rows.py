"""Rows for the shipped tool-dispatcher template (prompts/tool_dispatcher.toml): one request each,
drawn from phrasings of its catalogue's functions with random places, dates, people and amounts,
so no two rows share more than the system prompt and a few words. Deterministic for a seed.

    python benchmarks/tool_dispatcher_rows.py 200000 > rows.jsonl
    chunkgen run -t prompts/tool_dispatcher.toml -q rows.jsonl -o out.jsonl --max-new-tokens 1
"""

from __future__ import annotations

import argparse
import json
import random
import sys

CITIES = [
    "Oslo", "Lisbon", "Nairobi", "Osaka", "Lima", "Quebec", "Tromso", "Porto", "Seville", "Hanoi",
    "Denver", "Cork", "Tallinn", "Perth", "Recife", "Accra", "Bergen", "Kyoto", "Leeds", "Graz",
]  # fmt: skip
PEOPLE = ["anna", "tom", "li", "omar", "sara", "jon", "mia", "raj", "eva", "noah", "ines", "kofi"]
SERVICES = ["billing-api", "search", "auth", "checkout", "reports", "mailer", "ingest", "gateway"]
HOSTS = ["db-1", "web-3", "cache-2", "queue-7", "batch-4", "edge-9"]
CURRENCIES = ["EUR", "USD", "GBP", "JPY", "NOK", "CHF", "INR", "BRL"]
LANGUAGES = ["French", "German", "Japanese", "Swahili", "Portuguese", "Korean", "Polish"]
CUISINES = ["Thai", "Ethiopian", "Italian", "Georgian", "Peruvian", "vegan", "sushi"]
THINGS = ["the plants", "the invoice", "mum's birthday", "the car service", "the visa form", "the rent"]
SYMBOLS = ["AAPL", "NVDA", "SAP", "TSLA", "ASML", "NOVO", "EQNR"]
AIRPORTS = ["OSL", "LIS", "NRT", "JFK", "CDG", "GRU", "NBO", "SYD", "YYZ", "DXB"]


def _date(r: random.Random) -> str:
    return f"2026-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}"


def _time(r: random.Random) -> str:
    return f"{r.randint(6, 22):02d}:{r.choice(('00', '15', '30', '45'))}"


def _email(r: random.Random) -> str:
    return f"{r.choice(PEOPLE)}{r.randint(1, 99)}@example.com"


PHRASINGS = [
    lambda r: f"Will it rain in {r.choice(CITIES)} over the next {r.randint(2, 14)} days?",
    lambda r: f"How warm is it in {r.choice(CITIES)} right now, in {r.choice(('metric', 'imperial'))}?",
    lambda r: (
        f'Put "{r.choice(THINGS)}" in my calendar on {_date(r)} at {_time(r)} for {r.randint(1, 12) * 15} minutes.'
    ),
    lambda r: f"What is in my {r.choice(('work', 'personal'))} calendar between {_date(r)} and {_date(r)}?",
    lambda r: f"Cancel event ev-{r.randint(1000, 99999)} and {r.choice(('tell', 'do not tell'))} the attendees.",
    lambda r: f"Email {_email(r)} that the review of ticket {r.randint(100, 99999)} moves to {_date(r)}.",
    lambda r: f"Find emails from {_email(r)} about invoice {r.randint(1000, 9999)} after {_date(r)}.",
    lambda r: (
        f"Remind me about {r.choice(THINGS)} on {_date(r)} at {_time(r)}, {r.choice(('daily', 'weekly', 'once'))}."
    ),
    lambda r: (
        f"Add a {r.choice(('low', 'medium', 'high'))} priority task to fix bug #{r.randint(1, 99999)} due {_date(r)}."
    ),
    lambda r: f"Mark task T-{r.randint(1, 999999)} as done.",
    lambda r: f"How many {r.choice(CURRENCIES)} is {r.randint(1, 99999)} {r.choice(CURRENCIES)}?",
    lambda r: f"What does {r.choice(SYMBOLS)} trade at? Quote #{r.randint(1, 9999)}.",
    lambda r: (
        f"Book {r.randint(1, 6)} {r.choice(('economy', 'business'))} seats {r.choice(AIRPORTS)} to {r.choice(AIRPORTS)} on {_date(r)}."
    ),
    lambda r: (
        f"A hotel in {r.choice(CITIES)} from {_date(r)} to {_date(r)} under {r.randint(60, 400)} {r.choice(CURRENCIES)} a night."
    ),
    lambda r: f"Find a {r.choice(CUISINES)} place in {r.choice(CITIES)} for {r.randint(2, 12)} people open now.",
    lambda r: f"Table for {r.randint(2, 10)} at restaurant r-{r.randint(100, 9999)} on {_date(r)} at {_time(r)}.",
    lambda r: (
        f"How do I get from {r.choice(CITIES)} station to gate {r.randint(1, 80)} by {r.choice(('bike', 'transit', 'car'))}?"
    ),
    lambda r: f'Translate "order {r.randint(1, 99999)} has shipped" into {r.choice(LANGUAGES)}.',
    lambda r: f"Summarize document doc-{r.randint(1, 999999)} in {r.randint(5, 30) * 10} words.",
    lambda r: f"Run SELECT count(*) FROM orders WHERE day = '{_date(r)}' AND shop = {r.randint(1, 999)}.",
    lambda r: (
        f"Open a {r.choice(('low', 'high', 'critical'))} ticket: laptop {r.randint(1000, 9999)} will not boot after update."
    ),
    lambda r: (
        f"Restart {r.choice(SERVICES)} in {r.choice(('dev', 'staging', 'production'))}, it hangs on job {r.randint(1, 9999)}."
    ),
    lambda r: (
        f"Show {r.choice(('cpu', 'memory', 'disk', 'latency'))} of {r.choice(HOSTS)} for the last {r.randint(5, 120)} minutes."
    ),
    lambda r: (
        f"Play something by artist no. {r.randint(1, 5000)} in the {r.choice(('kitchen', 'office'))} at volume {r.randint(10, 90)}."
    ),
]


def rows(n: int, seed: int = 0):
    r = random.Random(seed)
    for i in range(n):
        yield {"id": f"t{i:07d}", "request": r.choice(PHRASINGS)(r)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", type=int, help="how many rows")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    out = sys.stdout
    for row in rows(args.rows, args.seed):
        out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
