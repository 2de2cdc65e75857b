#!/usr/bin/env python3
"""docs/cli.md from sppo's own --help, and the checks that keep the docs true to it.

    python3 scripts/cli_docs.py build/sppo > docs/cli.md       # write it
    python3 scripts/cli_docs.py build/sppo --check docs/cli.md  # exit 1 when it is stale
    python3 scripts/cli_docs.py build/sppo --names README.md docs/*.md
                                  # exit 1 when a file names an option no command has

Every command's help, in the order `sppo --help` lists them (bench's subcommands too).
--names accepts the options of sppo's commands, of scripts/tokenize_text.py and passkey.py and of the
launchers, peer scripts and install scripts the docs show (OTHERS).
"""
import re
import subprocess
import sys

# Options of the launchers, peer scripts and install scripts the docs show (mpirun, srun,
# bench/peers, scripts/install-hf.sh).
OTHERS = {"--hostfile", "--ntasks-per-node", "--mpi", "--oversubscribe", "--bind-to", "--profile", "--json",
          "--seq-len", "--qwen3", "--optional",
          # docs/launch.md: srun's and sbatch's, mpirun's, docker's
          "--nodes", "--cpus-per-task", "--gpus-per-task", "--job-name", "--time", "--output",
          "--allow-run-as-root", "--mca", "--shm-size", "--ulimit"}


def help_text(sppo, path):
    r = subprocess.run([sppo, *path, "--help"], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"cli_docs.py: `sppo {' '.join(path)} --help` exited {r.returncode}: {r.stderr.strip()}")
    return r.stdout


def subcommands(text):
    """The names under a help text's "Subcommands:" heading."""
    names, inside = [], False
    for line in text.splitlines():
        if line.startswith("Subcommands:"):
            inside = True
        elif inside and line.startswith("  ") and line.strip():
            names.append(line.split()[0])
        elif inside and line.strip():
            inside = False
    return names


def commands(sppo, path=()):
    text = help_text(sppo, list(path))
    out = [(list(path), text)] if path else []
    for name in subcommands(text):
        out += commands(sppo, (*path, name))
    return out


def markdown(sppo):
    top = help_text(sppo, [])
    parts = ["# sppo's command line",
             "",
             "Every command and option, as `sppo COMMAND --help` prints them (this file is written by",
             "`python3 scripts/cli_docs.py build/sppo > docs/cli.md`; a test fails when it is stale).",
             "`train`, `grads` and `plan` also read any option from a TOML file: `--config FILE`.",
             "",
             "```text", top.rstrip(), "```"]
    for path, text in commands(sppo):
        if subcommands(text):
            continue  # a group (bench): its commands follow
        parts += ["", f"## sppo {' '.join(path)}", "", "```text", text.rstrip(), "```"]
    return "\n".join(parts) + "\n"


def option_names(sppo):
    names = set(OTHERS)
    for _, text in commands(sppo):
        names |= set(re.findall(r"--[a-z][a-z0-9-]*", text))
    for script in (["scripts/tokenize_text.py"], ["scripts/passkey.py", "haystacks"], ["scripts/passkey.py", "grid"]):
        out = subprocess.run([sys.executable, *script, "--help"], capture_output=True, text=True)
        names |= set(re.findall(r"--[a-z][a-z0-9-]*", out.stdout))
    return names


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sppo, rest = sys.argv[1], sys.argv[2:]
    if not rest:
        sys.stdout.write(markdown(sppo))
        return
    if rest[0] == "--check" and len(rest) == 2:
        want = markdown(sppo)
        have = open(rest[1], encoding="utf-8").read()
        if have != want:
            sys.exit(f"{rest[1]} is not what sppo's --help says now; rewrite it: "
                     f"python3 scripts/cli_docs.py {sppo} > {rest[1]}")
        print(f"{rest[1]} matches sppo's --help")
        return
    if rest[0] == "--names":
        known = option_names(sppo)
        bad = []
        for path in rest[1:]:
            for n, line in enumerate(open(path, encoding="utf-8"), 1):
                for name in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", line):
                    if name not in known:
                        bad.append(f"{path}:{n}: {name}")
        if bad:
            sys.exit("options no command has:\n  " + "\n  ".join(bad))
        print(f"every option {', '.join(rest[1:])} name exists")
        return
    sys.exit(__doc__)


if __name__ == "__main__":
    main()
