from chunkgen.cli import app

app(prog_name="chunkgen")
