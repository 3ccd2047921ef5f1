"""The command line is declared once and documented truthfully.

docs/SERVER.md's option table is compared with what `python -m minisgl --help` prints: every
option (aliases too) is documented, nothing documented is missing from `--help`, and each row's
default is the one `--help` states ("off" for a switch). The parser built from the config fields
must also give back those configs' own defaults, and stay torch-free.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

REPO = Path(__file__).resolve().parents[1]
SERVER_MD = REPO / "docs" / "SERVER.md"

Options = Dict[str, Tuple[Tuple[str, ...], str]]  # primary flag -> (every flag, default)

_FLAG = re.compile(r"--[a-z][a-z0-9-]*")


def help_options(text: str) -> Options:
    """The options of an argparse `--help` printed wide enough that no help text wraps (a long
    invocation puts its help on the next line)."""
    entries: List[List[str]] = []  # [invocation, help]
    for line in text.splitlines():
        m = re.match(r"^  (-\S.*?)(?:\s{2,}(.*))?$", line)
        if m is not None:
            entries.append([m.group(1), m.group(2) or ""])
        elif entries and line.startswith("   "):
            entries[-1][1] += " " + line.strip()
        else:
            entries.append(["", ""])  # a group heading or a blank line ends the entry
    out: Options = {}
    for invocation, help_text in entries:
        flags = tuple(_FLAG.findall(invocation))
        if not flags or flags[0] == "--help":
            continue
        default = re.search(r"\(default: (.*)\)$", help_text)
        out[flags[0]] = (flags, default.group(1) if default else "off")
    return out


def doc_options(markdown: str) -> Options:
    """The rows of the option table under '## Command line': `--flag` (alias `--other`) | default | meaning."""
    section = markdown.split("## Command line", 1)[1].split("\n## ", 1)[0]
    out: Options = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`--"):
            continue
        flags = tuple(_FLAG.findall(cells[0]))
        assert flags[0] not in out, f"docs/SERVER.md documents {flags[0]} twice"
        out[flags[0]] = (flags, cells[1].replace("`", ""))
    return out


def differences(helped: Options, documented: Options) -> List[str]:
    """What docs/SERVER.md gets wrong about `--help`, one line each (empty: nothing)."""
    problems = [f"{flag}: in --help, missing from docs/SERVER.md" for flag in helped if flag not in documented]
    problems += [f"{flag}: documented, but --help has no such option" for flag in documented if flag not in helped]
    for flag, (flags, default) in helped.items():
        if flag not in documented:
            continue
        doc_flags, doc_default = documented[flag]
        if doc_flags != flags:
            problems.append(f"{flag}: --help names it {' / '.join(flags)}, the doc {' / '.join(doc_flags)}")
        if doc_default != default:
            problems.append(f"{flag}: --help's default is {default!r}, the doc says {doc_default!r}")
    return problems


@pytest.fixture(scope="module")
def help_text() -> str:
    env = {**os.environ, "COLUMNS": "1000"}  # argparse wraps at the terminal width: one line per option
    env.pop("MINISGL_API_KEY", None)
    proc = subprocess.run([sys.executable, "-m", "minisgl", "--help"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_server_md_documents_every_option_with_its_default(help_text: str) -> None:
    helped = help_options(help_text)
    assert len(helped) >= 44 and "--kv-cache-dtype" in helped and "--cuda-graph-max-tokens" in helped
    problems = differences(helped, doc_options(SERVER_MD.read_text()))
    assert not problems, "docs/SERVER.md and --help disagree:\n" + "\n".join(problems)


def test_the_comparison_notices_drift(help_text: str) -> None:
    helped = help_options(help_text)
    doc = SERVER_MD.read_text()
    assert differences(helped, doc_options(doc)) == []
    dropped = doc.replace("| `--page-size` | 1 |", "| `--page-sizes` | 1 |")
    assert differences(helped, doc_options(dropped)) == [
        "--page-size: in --help, missing from docs/SERVER.md",
        "--page-sizes: documented, but --help has no such option",
    ]
    changed = doc.replace("| `--memory-ratio` | 0.9 |", "| `--memory-ratio` | 0.8 |")
    assert differences(helped, doc_options(changed)) == ["--memory-ratio: --help's default is '0.9', the doc says '0.8'"]
    no_alias = doc.replace("| `--tp` (alias `--tp-size`) |", "| `--tp` |")
    assert differences(helped, doc_options(no_alias)) == ["--tp: --help names it --tp / --tp-size, the doc --tp"]


def test_parsed_defaults_are_the_configs_defaults() -> None:
    """`python -m minisgl` with no options builds the same SchedulerConfig as its own defaults."""
    import dataclasses

    from minisgl.scheduler import SchedulerConfig
    from minisgl.server.args import ServerArgs, parse_args
    from minisgl.utils.cli import options

    args = parse_args([])
    assert args.engine == {f.name: f.default for f, _ in options(SchedulerConfig)}
    assert dataclasses.asdict(args) == dataclasses.asdict(ServerArgs(engine=args.engine))


def test_switches_and_named_choices_reach_their_fields() -> None:
    from minisgl.server.args import parse_args

    args = parse_args(
        ["--load-format", "dummy", "--disable-overlap", "--disable-mixed-batches", "--deterministic", "--shell",
         "--chunked-prefill-size", "64", "--max-running-requests", "3", "--num-pages", "9", "--dtype", "float32"]
    )  # fmt: skip
    args.model_path = "/models/x"
    cfg = args.scheduler_config()
    assert (cfg.use_dummy_weight, cfg.enable_overlap, cfg.mixed_batches, cfg.deterministic) == (True, False, False, True)
    assert (cfg.max_extend_tokens, cfg.max_running_req, cfg.num_page_override) == (64, 3, 9) and args.shell
    assert parse_args(["--max-prefill-length", "32"]).engine["max_extend_tokens"] == 32
    for bad in (["--load-format", "fast"], ["--num-pages", "0"], ["--chunked-prefill-size", "x"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_the_api_key_comes_from_the_environment_and_stays_out_of_help() -> None:
    code = (
        "import os, sys; os.environ['MINISGL_API_KEY'] = 'sekrit'\n"
        "from minisgl.server.args import build_parser, parse_args\n"
        "assert parse_args([]).api_key == 'sekrit' and parse_args(['--api-key', 'k']).api_key == 'k'\n"
        "assert 'sekrit' not in build_parser().format_help()\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


def test_parsing_the_command_line_imports_no_torch() -> None:
    """The API server process never needs torch: building and parsing the command line (from the
    engine's and the scheduler's config fields) must not import it."""
    code = (
        "import sys\n"
        "from minisgl.server.args import parse_args\n"
        "parse_args(['--page-size', '4'])\n"
        "import minisgl.server.launch, minisgl.shell\n"
        "assert 'torch' not in sys.modules, 'the command line imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)
