"""The shell commands of README.md and BUILD.md, and a runner for them.

``commands(path)`` reads every ```bash block of a Markdown file and returns its commands in order,
as (section heading, command text, argv): ``\\`` continuations joined, comments dropped, a line of
commands joined by ``&&`` split into its commands. tests/test_readme.py runs them (at small sizes)
or names why not; tests/test_generate_cli.py runs the serving ones.

Run as a script, ``python tests/readme_commands.py COMMANDS.json RESULTS.json`` runs the ``jaxpar``
commands of the JSON list (argv lists, ``jaxpar`` first) one after another in this process, as
``jaxpar.cli.main(argv)`` (one JAX start-up for all of them: the device count of XLA_FLAGS must be
set before), and writes each one's exit status, seconds and output to RESULTS.json as it goes.
"""
from __future__ import annotations

import contextlib
import io
import json
import pathlib
import re
import shlex
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def bash_blocks(path) -> list[tuple[str, str]]:
    """(the heading above it, its text) for each ```bash block of the Markdown file, in order."""
    text = pathlib.Path(path).read_text()
    blocks, heading = [], ""
    for part in re.split(r"(^```bash\n.*?^```$)", text, flags=re.S | re.M):
        if part.startswith("```bash\n"):
            blocks.append((heading, part[len("```bash\n"):-len("```")]))
        else:
            headings = re.findall(r"^#+ (.*)$", part, re.M)
            heading = headings[-1] if headings else heading
    return blocks


def block_commands(block: str) -> list[tuple[str, list[str]]]:
    """(command text, argv) of each command of a shell block, in order."""
    found = []
    for line in re.sub(r"\\\n\s*", " ", block).splitlines():
        words = shlex.split(line, comments=True)
        while words:
            cut = words.index("&&") if "&&" in words else len(words)
            argv, words = words[:cut], words[cut + 1:]
            if argv:
                found.append((shlex.join(argv), argv))
    return found


def commands(path) -> list[tuple[str, str, list[str]]]:
    """(heading, command text, argv) of each command of each ```bash block of the file, in order."""
    return [(heading, text, argv) for heading, block in bash_blocks(path) for text, argv in block_commands(block)]


def _cpu_seconds() -> float:
    """CPU time of this process and of the processes it has waited for (``jaxpar launch``'s)."""
    import resource

    return sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


def run(argvs: list[list[str]], results_path: str) -> None:
    from jaxpar import cli

    results = []
    for argv in argvs:
        assert argv[0] == "jaxpar", argv
        out = io.StringIO()
        began, cpu = time.perf_counter(), _cpu_seconds()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            try:
                status = cli.main(argv[1:])
            except SystemExit as exit:  # argparse
                status = exit.code if isinstance(exit.code, int) else 2
            except Exception as err:  # a crash: the status a Python process would end with
                import traceback

                traceback.print_exc()
                status = f"crashed: {type(err).__name__}: {err}"
        results.append({"argv": argv, "status": status, "seconds": round(time.perf_counter() - began, 1),
                        "cpu_seconds": round(_cpu_seconds() - cpu, 1), "output": out.getvalue()})
        print(f"{results[-1]['seconds']:7.1f} s {results[-1]['cpu_seconds']:7.1f} s of CPU  status {status}  {shlex.join(argv)}",
              file=sys.__stderr__, flush=True)
        pathlib.Path(results_path).write_text(json.dumps(results))


if __name__ == "__main__":
    run(json.loads(pathlib.Path(sys.argv[1]).read_text()), sys.argv[2])
