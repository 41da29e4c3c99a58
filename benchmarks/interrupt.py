"""What an interrupt keeps: a 300-row labelling job (a ~1,750-token guideline as the template's
system prompt, a JSON schema, rows of ~35 tokens, max_new_tokens 128), run whole, then stopped
with SIGINT at shares of its wall time and resumed.

    python benchmarks/interrupt.py write JOB_DIR            # the template, schema and rows
    python benchmarks/interrupt.py full JOB_DIR [-- RUN_ARGS]
    python benchmarks/interrupt.py stop JOB_DIR --wall SECONDS --at 0.25,0.5,0.75 [-- RUN_ARGS]

`full` runs `chunkgen run` on the job once and prints its process wall time, when the model was
loaded, the job's wall time after that (job_wall_s), when its first record reached the output file,
the record count over time and the records written. `stop` starts a fresh run for each share,
sends SIGINT at that share of `--wall` (a `full` run's job_wall_s) after the model is loaded, counts
the records the stopped run kept, then runs the same command with `--resume` and checks that every
row has exactly one answer. RUN_ARGS go to `chunkgen run` as given (`--max-batch 256`, `--dtype fp32`). Each result is
one JSON line on standard output. Everything is generated here from a fixed seed: no file outside
the repository is read, and the same JOB_DIR is written byte for byte on every machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROWS = 300
MAX_NEW_TOKENS = 128
LABELS = ("praise", "complaint_quality", "complaint_delivery", "complaint_price", "question", "mixed", "spam")

# The guideline: a policy a labelling team would write, long enough (about 1,750 tokens with the
# default model's tokenizer) that the shared prefix, not the rows, dominates each prompt.
GUIDELINE_HEAD = """You label customer reviews of an online shop that sells home, kitchen and outdoor goods.
Read the review, choose exactly one label from the list below and give a one-sentence reason.
Reply with one JSON object and nothing else: {"label": "<label>", "reason": "<one sentence>"}.

Labels:
- praise: the customer is satisfied overall and says something good about the product or the service.
- complaint_quality: the product broke, does not work, is not as described, or is of poor make.
- complaint_delivery: the parcel was late, lost, damaged in transit, or the courier behaved badly.
- complaint_price: the customer finds the price, a fee or the shipping cost too high for what was received.
- question: the review mainly asks something (how to use, whether a part fits, when stock returns).
- mixed: clear praise and a clear complaint of similar weight in the same review.
- spam: advertising, links, text unrelated to the product, or a review of another shop.
"""
TOPICS = (
    ("Sarcasm", "Treat obvious sarcasm as its meaning, not its words: 'great, another broken handle' is a complaint."),
    ("Stars", "Ignore any star count the customer writes in the text; label what the words say."),
    ("Several issues", "When a review names several problems, label the one the customer dwells on most."),
    (
        "Returns",
        "A review that only describes a return or refund without judging it is a question if it asks "
        "anything, otherwise mixed only when it also praises something.",
    ),
    ("Gifts", "A gift that the recipient liked is praise even when the buyer never used the product."),
    ("Language", "Reviews may contain spelling mistakes, slang or a second language; label the meaning."),
    ("Length", "A one-word review such as 'excellent' or 'junk' is still labelled; the reason may be short."),
    ("Service", "Praise or complaints about customer service count like those about the product."),
    ("Competitors", "A comparison with another brand is labelled by what it says about our product."),
    ("Safety", "Any mention of injury, fire, smoke or an electric shock is complaint_quality, whatever else it says."),
    ("Packaging", "Damaged outer packaging with an intact product is complaint_delivery, not complaint_quality."),
    ("Discounts", "A customer happy with a discount but unhappy with the product is complaint_quality."),
)
EXAMPLE_PRODUCTS = (
    "kettle",
    "garden hose",
    "frying pan",
    "desk lamp",
    "tent",
    "blender",
    "rug",
    "thermos",
    "drill",
    "bed sheet",
    "camping stove",
    "knife set",
    "office chair",
    "bird feeder",
    "toaster",
    "backpack",
)
REVIEW_OPENERS = (
    "Bought this {product} last month.",
    "Second {product} from this shop.",
    "The {product} arrived on {day}.",
    "Got the {product} as a gift for my sister.",
    "I was looking for a cheap {product}.",
    "Ordered the large {product} for our cabin.",
)
REVIEW_BODIES = (
    "It works well and looks even better than in the photos, very happy with it.",
    "After two weeks the handle came off and now it is useless, really disappointed.",
    "The box was crushed and it came five days later than promised by the courier.",
    "Way too expensive for such thin material, plus the shipping fee was silly.",
    "Does anyone know if the replacement parts from the older model fit this one?",
    "Quality is great but the delivery took almost a month, which was annoying.",
    "Visit my page for the best deals on phones and watches, link in my profile!!",
    "Stopped working after the first use, the switch just clicks and nothing happens.",
    "Exactly what I needed, sturdy and easy to clean, would buy again for sure.",
    "Nice enough, but for this price I expected a metal frame and not plastic.",
)
REVIEW_CLOSERS = (
    "Thanks for reading.",
    "Would not recommend it to anyone.",
    "Five stars from me, honestly.",
    "Any advice on this is welcome.",
    "We will see how it holds up.",
    "Meh, it is what it is.",
)
EXAMPLES = 22  # worked examples in the guideline
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday")


def guideline() -> str:
    rng = random.Random(54)
    parts = [GUIDELINE_HEAD, "Rules for hard cases:"]
    for i, (name, rule) in enumerate(TOPICS, 1):
        parts.append(f"{i}. {name}. {rule}")
    parts.append("\nWorked examples (review, then the answer you would give):")
    for i in range(EXAMPLES):
        product = EXAMPLE_PRODUCTS[i % len(EXAMPLE_PRODUCTS)]
        body = REVIEW_BODIES[i % len(REVIEW_BODIES)]
        label = (
            "praise",
            "complaint_quality",
            "complaint_delivery",
            "complaint_price",
            "question",
            "mixed",
            "spam",
            "complaint_quality",
            "praise",
            "complaint_price",
        )[i % len(REVIEW_BODIES)]
        reason = f"The customer's main point about the {product} fits {label.replace('_', ' ')}."
        parts.append(f'- "{rng.choice(REVIEW_OPENERS).format(product=product, day=rng.choice(DAYS))} {body}"')
        parts.append(f'  -> {{"label": "{label}", "reason": "{reason}"}}')
    parts.append("\nAnswer with the JSON object only.")
    return "\n".join(parts) + "\n"


SCHEMA = {
    "type": "object",
    "properties": {"label": {"enum": list(LABELS)}, "reason": {"type": "string", "maxLength": 300}},
    "required": ["label", "reason"],
    "additionalProperties": False,
}


def rows() -> list[dict]:
    rng = random.Random(300)
    out = []
    for i in range(ROWS):
        product = rng.choice(EXAMPLE_PRODUCTS)
        opener = rng.choice(REVIEW_OPENERS).format(product=product, day=rng.choice(DAYS))
        text = f"{opener} {rng.choice(REVIEW_BODIES)} {rng.choice(REVIEW_CLOSERS)}".strip()
        out.append({"id": f"r{i:03d}", "review": text})
    return out


def write(job: Path) -> None:
    job.mkdir(parents=True, exist_ok=True)
    (job / "review.schema.json").write_text(json.dumps(SCHEMA, indent=2) + "\n")
    (job / "review.toml").write_text(
        'name = "review"\n'
        'description = "Label a customer review with one of seven labels and a reason."\n'
        f"system = {json.dumps(guideline())}\n"
        'user = "Review: {review}"\n\n'
        f"[sampling]\nmax_new_tokens = {MAX_NEW_TOKENS}\n\n"
        '[output]\njson_schema = "review.schema.json"\n'
    )
    (job / "reviews.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows()))


def command(job: Path, out: Path, run_args: list[str], resume: bool = False) -> list[str]:
    return [
        sys.executable,
        "-m",
        "chunkgen",
        "run",
        "-t",
        str(job / "review.toml"),
        "-q",
        str(job / "reviews.jsonl"),
        "-o",
        str(out),
        "--json-log",
        *(["--resume"] if resume else []),
        *run_args,
    ]


def records(out: Path) -> list[dict]:
    if not out.exists():
        return []
    return [json.loads(line) for line in out.read_text().splitlines() if line.strip()]


def timed_run(cmd: list[str], out: Path, log: Path, stop_at: float | None = None) -> dict:
    """Runs cmd; notes when the model is loaded (the log's model_loaded event) and when records
    reach out (the first, and each change of their count); sends SIGINT stop_at seconds after the
    model is loaded: the job's time, not the process start's (imports and loading are no rows)."""
    start = time.monotonic()
    first = loaded = None
    timeline: list[tuple[float, int]] = []  # (seconds, records on disk) whenever the count changed
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
        sent = None
        while proc.poll() is None:
            now = time.monotonic() - start
            if loaded is None and b'"model_loaded"' in log.read_bytes():
                loaded = now
            if out.exists() and out.stat().st_size > 0:
                first = now if first is None else first
                count = out.read_bytes().count(b"\n")
                if not timeline or timeline[-1][1] != count:
                    timeline.append((round(now, 1), count))
            if stop_at is not None and sent is None and loaded is not None and now >= loaded + stop_at:
                proc.send_signal(signal.SIGINT)
                sent = now
            time.sleep(0.2)
    wall = time.monotonic() - start
    if first is None and out.exists() and out.stat().st_size > 0:
        first = wall
    got = records(out)
    ids = [r.get("id") for r in got]
    return {
        "exit": proc.returncode,
        "wall_s": round(wall, 1),
        "loaded_s": None if loaded is None else round(loaded, 1),
        "job_wall_s": None if loaded is None else round(wall - loaded, 1),
        "first_record_s": None if first is None else round(first, 1),
        "sigint_at_s": None if sent is None else round(sent, 1),
        "records": len(got),
        "distinct_ids": len(set(ids)),
        "errors": sum(1 for r in got if r.get("error")),
        "load_avg": [round(x, 2) for x in os.getloadavg()],
        "timeline": timeline,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("write", "full", "stop"))
    ap.add_argument("job", type=Path)
    ap.add_argument("--wall", type=float, help="stop: a full run's job_wall_s (seconds from model loaded to exit)")
    ap.add_argument("--at", default="0.25,0.5,0.75", help="stop: shares of --wall, comma-separated")
    argv = sys.argv[1:]
    # What follows -- goes to chunkgen run as given; split by hand, since argparse's REMAINDER after
    # a positional would also swallow this script's own options written after JOB_DIR.
    run_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.what == "write":
        write(args.job)
        return
    tag = re.sub(r"[^A-Za-z0-9.]+", "_", "-".join(Path(a).name for a in run_args)) or "defaults"
    if args.what == "full":
        out = args.job / f"full-{tag}.jsonl"
        out.unlink(missing_ok=True)
        result = timed_run(command(args.job, out, run_args), out, args.job / f"full-{tag}.log")
        print(json.dumps({"run": "full", "args": run_args, **result}), flush=True)
        return
    if args.wall is None:
        ap.error("stop needs --wall (a full run's wall time)")
    for share in (float(s) for s in args.at.split(",")):
        out = args.job / f"stop{share:g}-{tag}.jsonl"
        out.unlink(missing_ok=True)
        stopped = timed_run(
            command(args.job, out, run_args), out, args.job / f"stop{share:g}-{tag}.log", share * args.wall
        )
        kept = stopped["records"]
        resumed = timed_run(command(args.job, out, run_args, resume=True), out, args.job / f"resume{share:g}-{tag}.log")
        print(
            json.dumps(
                {
                    "run": "stop",
                    "share": share,
                    "args": run_args,
                    "stopped": stopped,
                    "kept_share": round(kept / ROWS, 3),
                    "resumed": resumed,
                    "complete": resumed["records"] == resumed["distinct_ids"] == ROWS,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
