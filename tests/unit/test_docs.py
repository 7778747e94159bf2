"""The docs are reference, checked: every page within its length, no dated history outside
CHANGELOG.md, no dead relative link, every listed term defined in docs/glossary.md and linked from
the pages that use it, and every documented ``python -m parallel_lab[.plan]`` command composable by
Hydra (composed with the project's own ``compose_config``, never run).

Each check is a function of a repository root, so the planted tests below run it on a bad page in
a temporary folder and see it fail. Each failure message names the file, the line and the fix.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PAGE_LIMIT = 300  # lines of a docs/*.md page
README_LIMIT = 150  # lines of README.md

# Pages not yet restructured into reference (history still inside): skipped by the length and the
# dated-line checks only. This list only shrinks; it is empty when issue 48 item 1 is done.
PENDING: set[str] = set()

# Terms a newcomer trips on: each must have a heading in docs/glossary.md (its anchor is the
# key), and a page that uses one must link docs/glossary.md. The pattern is what counts as a use.
TERMS: dict[str, str] = {
    "psi": r"Ψ",  # the heading "## Psi"
    "mfu": r"\bMFU\b",
    "envelope": r"\benvelope\b",
    "noise-floor": r"\bnoise floor\b",
    "held-out": r"\bheld[- ]out\b",
    "busbw": r"\bbusbw\b",
    "algbw": r"\balgbw\b",
    "foreign-dispatch": r"\bforeign (CPU )?(dispatch|kernels)\b",
    "parity": r"\bparity\b",
    "model-state": r"\bmodel state\b",
    "bubble": r"\bbubbles?\b",
    "exposed-communication": r"\bexposed[ _]comm",
    "micro-batch": r"\bmicro-batch",
    "calibration": r"\bcalibration\b",
}

# An ISO date (2026-11-27), a run folder's stamp (20261127T0553) or a clock time (10:55, 10:55:03)
# outside inline code (fenced blocks are checked too: a comment there is prose) is history, which
# belongs in CHANGELOG.md (one dated line per change). Durations are written in seconds or minutes
# ("462 s", "7 min"), never as m:ss. benchmarks/results/<file> paths are exempt (their names carry
# the run's stamp).
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b|(?<!\d)20\d{6}T\d{4}")
# Session wording dates a line as surely as a date does: the reader has no "today" or "this session".
SESSION = re.compile(r"\b(today(?:'s)?|this session|last session|earlier code|yesterday)\b", re.IGNORECASE)
CLOCK = re.compile(r"(?<![\w.:/\[-])\d{1,2}:[0-5]\d(:[0-5]\d)?(?![\w:/])")
RESULTS_PATH = re.compile(r"benchmarks/results/[\w./-]*")
# Ψ is fp32 parameter bytes everywhere (docs/glossary.md#psi): "Ψ = 321,290 parameters" or "Ψ parameters"
# uses it as a count.
PSI_AS_COUNT = re.compile(r"Ψ\s*=\s*[\d.,]+\s*[KMB]?\s*param|Ψ\s+param", re.IGNORECASE)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
COMMAND = re.compile(r"python -m (parallel_lab(?:\.[\w.]+)?)\b(.*)")


def pages(root: Path) -> list[Path]:
    """Every page the checks judge: README.md and docs/*.md."""
    return [p for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))] if p.exists()]


def rel(root: Path, path: Path) -> str:
    return path.relative_to(root).as_posix()


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line with `inline code` blanked) for every line outside ``` fences."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, re.sub(r"`[^`]*`", "``", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The #anchors of a page's headings (repeated headings get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    lines = path.read_text().splitlines()
    for number, line in prose_lines(path.read_text()):
        if not re.match(r"#{1,6}\s", line):
            continue
        base = slug(lines[number - 1].lstrip("#"))
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out


def check_length(root: Path, pending: set[str] = frozenset()) -> list[str]:
    errors = []
    for page in pages(root):
        name = rel(root, page)
        limit = README_LIMIT if name == "README.md" else PAGE_LIMIT
        count = len(page.read_text().splitlines())
        if count > limit and name not in pending:
            errors.append(
                f"{name}: {count} lines, over the limit of {limit}: split it into reference pages by topic "
                f"(each <= {PAGE_LIMIT} lines), move history to CHANGELOG.md and measurements to benchmarks/results/"
            )
    return errors


def check_dates(root: Path, pending: set[str] = frozenset()) -> list[str]:
    errors = []
    for page in pages(root):
        name = rel(root, page)
        if name in pending:
            continue
        for number, line in enumerate(page.read_text().splitlines(), 1):
            text = re.sub(r"`[^`]*`", "``", RESULTS_PATH.sub("", line))
            found = DATE.search(text) or CLOCK.search(text) or SESSION.search(text)
            if found:
                errors.append(
                    f"{name}:{number}: dated line ('{found.group(0)}'): docs are reference; put the history in "
                    f"CHANGELOG.md (one line: '- YYYY-MM-DD <what changed>'), the measurement in benchmarks/results/ "
                    f"with its command, and write durations in seconds ('462 s'), not m:ss"
                )
    return errors


def check_links(root: Path) -> list[str]:
    """Dead relative links and anchors in the pages, CHANGELOG.md and benchmarks/results/*.md."""
    extra = [root / "CHANGELOG.md", *sorted((root / "benchmarks" / "results").glob("*.md"))]
    errors = []
    for page in pages(root) + [p for p in extra if p.exists()]:
        name = rel(root, page)
        for number, line in enumerate(page.read_text().splitlines(), 1):
            for m in LINK.finditer(line):
                target = m.group(1) or m.group(2)
                if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                    continue
                file, _, anchor = target.partition("#")
                dest = (page.parent / file).resolve() if file else page
                if not dest.exists():
                    errors.append(
                        f"{name}:{number}: dead link '{target}': {rel(root, page.parent)}/{file} does not exist"
                    )
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    errors.append(
                        f"{name}:{number}: dead anchor '{target}': no heading of {dest.name} has the anchor "
                        f"'#{anchor}' (anchors: lower case, punctuation dropped, spaces as '-')"
                    )
    return errors


def check_terms(root: Path) -> list[str]:
    glossary = root / "docs" / "glossary.md"
    defined = anchors(glossary) if glossary.exists() else set()
    errors = [
        f"docs/glossary.md: term '{key}' is not defined: add a heading whose anchor is '#{key}'"
        for key in TERMS
        if key not in defined
    ]
    for page in pages(root):
        name = rel(root, page)
        for number, line in prose_lines(page.read_text()):
            found = PSI_AS_COUNT.search(re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", line))  # [Ψ](link) reads as Ψ
            if found:
                errors.append(
                    f"{name}:{number}: Ψ used as a parameter count ('{found.group(0)}'): Ψ is the "
                    f"fp32 parameter bytes (glossary.md#psi); write the count as n parameters (Ψ = 4n bytes)"
                )
        if page == glossary:
            continue
        text = page.read_text()
        prose = "\n".join(line for _, line in prose_lines(text))
        used = [key for key, pattern in TERMS.items() if re.search(pattern, prose, re.IGNORECASE)]
        if used and "glossary.md" not in text:
            errors.append(
                f"{name}: uses {', '.join(used)} but never links the glossary: link each term's first use to "
                f"glossary.md#<term> (e.g. [Ψ](docs/glossary.md#psi) from README, [Ψ](glossary.md#psi) in docs/)"
            )
    return errors


COMMAND_WITHIN = 15  # a page's first fenced block (what the reader can run there) starts by this line
NO_COMMAND = {"docs/glossary.md"}  # pages with nothing to run
FIRST_SCREEN = 30  # README lines a reader sees first: exactly `make demo` and `make test` to run there


def check_openings(root: Path) -> list[str]:
    """Every docs page starts with what the reader can do there (a command block near the top); the
    README's first screen has exactly two commands, make demo and make test, and it links every page."""
    errors = []
    for page in pages(root):
        name = rel(root, page)
        lines = page.read_text().splitlines()
        fences = [i for i, line in enumerate(lines, 1) if line.lstrip().startswith("```")]
        if name.startswith("docs/") and name not in NO_COMMAND and not (fences and fences[0] <= COMMAND_WITHIN):
            errors.append(
                f"{name}: no command block in its first {COMMAND_WITHIN} lines: start the page with what the reader "
                f"can run there (a ```bash block right under the title), then the prose"
            )
    readme = root / "README.md"
    if readme.exists():
        lines = readme.read_text().splitlines()[:FIRST_SCREEN]
        commands, fenced = [], False
        for line in lines:
            if line.lstrip().startswith("```"):
                fenced = not fenced
            elif fenced and line.split("#")[0].strip():
                commands.append(line.split("#")[0].strip())
        if commands != ["make demo", "make test"]:
            errors.append(
                f"README.md: its first {FIRST_SCREEN} lines must hold exactly two commands, `make demo` and "
                f"`make test`, in one block; found {commands}"
            )
        text = readme.read_text()
        for page in sorted((root / "docs").glob("*.md")):
            if f"(docs/{page.name})" not in text and f"(docs/{page.name}#" not in text:
                errors.append(f"README.md: does not link docs/{page.name}: add a row to its Documentation table")
    return errors


def documented_commands(root: Path) -> list[tuple[str, int, str, list[str]]]:
    """(page, line, module, arguments) of every `python -m parallel_lab...` in code: fenced blocks
    (backslash continuations joined, `# comments` dropped) and inline code spans. A command with a
    placeholder (<x>, ..., …, [args]) is a pattern, not a command, and is left out."""
    found = []
    for page in pages(root):
        lines = page.read_text().splitlines()
        fenced, joined, start = False, "", 0
        for number, line in enumerate(lines, 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            if fenced:
                start = start or number
                joined += line.rstrip("\\") + " " if line.rstrip().endswith("\\") else line
                if line.rstrip().endswith("\\"):
                    continue
                candidates, joined, at = [joined.split(" #")[0]], "", start
                start = 0
            else:
                candidates, at = re.findall(r"`([^`]*)`", line), number
            for code in candidates:
                m = COMMAND.search(code)
                if not m or re.search(r"<|\.\.\.|…|\[args\]|\[hydra", m.group(2)):
                    continue
                try:
                    args = shlex.split(m.group(2))
                except ValueError:
                    continue
                found.append((rel(root, page), at, m.group(1), args))
    return found


def _variants(args: list[str]) -> list[list[str]]:
    """The Hydra overrides of a command line, one list per sweep value (flags like -m dropped)."""
    from hydra._internal.utils import get_args_parser

    from parallel_lab.config.compose import _sweep_variants

    known, _ = get_args_parser().parse_known_args(args)
    return _sweep_variants([a for a in known.overrides if not a.lstrip("+~").startswith("hydra")])


def _compose(groups: list[str]):
    """The config the project's compose_config makes from these group choices, or its one-line error."""
    from parallel_lab.config.compose import compose_config
    from parallel_lab.errors import ConfigError

    try:
        return compose_config(groups)
    except ConfigError as exc:
        return str(exc)


def _apply(base, overrides: list[str]) -> str | None:
    """Hydra's own last step of composing: the value overrides applied to the composed config (in
    struct mode, as compose does). None if they apply, else the one-line error of the command line."""
    import copy

    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from parallel_lab.config.compose import describe_compose_error

    cfg = copy.deepcopy(base)
    OmegaConf.set_struct(cfg, True)
    try:
        ConfigLoaderImpl._apply_overrides_to_config(OverridesParser.create().parse_overrides(overrides), cfg)
    except Exception as exc:  # every Hydra/OmegaConf error, as compose_config words it
        return describe_compose_error(exc)
    return None


def compose_errors(commands: list[list[str]]) -> list[str | None]:
    """Each command's compose error (None: composes). Hydra's compose takes ~0.2 s, so the config of
    each distinct set of group choices (strategy=, model=, +experiment=, ...) is composed once with
    compose_config, and each command's value overrides are then applied to it as compose applies
    them (``_apply``): the same result as composing every command, in a fraction of the time. A
    choice conf/config.yaml already makes (strategy=ddp, model=cnn) selects what the config holds
    without it, so it is left out of the key, except beside an experiment (whose own defaults may
    override that group: then the command line's choice is not the default's)."""
    from omegaconf import OmegaConf

    from parallel_lab.config.compose import CONF_DIR
    from parallel_lab.config.schema import CONFIG_GROUPS

    def is_group(override: str) -> bool:
        # plan.hardware=<name> is a group in disguise (compose_config loads conf/hardware/<name>.yaml)
        return override.lstrip("+~").partition("=")[0] in (*CONFIG_GROUPS, "experiment", "plan.hardware")

    entries = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "config.yaml").defaults)
    defaults = {f"{group}={choice}" for entry in entries if isinstance(entry, dict) for group, choice in entry.items()}

    def key_of(groups: list[str]) -> tuple[str, ...]:
        with_experiment = any(o.lstrip("+~").startswith("experiment=") for o in groups)
        return tuple(sorted(o for o in groups if with_experiment or o not in defaults))

    errors: list[str | None] = [None] * len(commands)
    bases: dict[tuple[str, ...], object] = {}
    for index, args in enumerate(commands):
        try:
            variants = _variants(args)
        except Exception as exc:  # a sweep's syntax error
            errors[index] = f"{type(exc).__name__}: {exc}"
            continue
        for variant in variants:
            key = key_of([o for o in variant if is_group(o)])
            if key not in bases:
                bases[key] = _compose(list(key))
            base = bases[key]
            error = base if isinstance(base, str) else _apply(base, [o for o in variant if not is_group(o)])
            errors[index] = errors[index] or error
    return errors


def check_commands(root: Path) -> list[str]:
    from parallel_lab.bench.__main__ import names

    errors = []
    hydra = [c for c in documented_commands(root) if c[2] in ("parallel_lab", "parallel_lab.plan")]
    # DeepSpeed's own flags (--deepspeed_config FILE) are translated from a user's file: not composable here.
    hydra = [c for c in hydra if c[3][:1] != ["checkpoint"] and not any(a.startswith("--deep") for a in c[3])]
    for (name, number, module, args), error in zip(hydra, compose_errors([c[3] for c in hydra])):
        if error:
            errors.append(f"{name}:{number}: `python -m {module} {' '.join(args)}`: Hydra cannot compose it: {error}")
    for name, number, module, args in documented_commands(root):
        if module == "parallel_lab.bench" and args and args[0] not in names():
            errors.append(
                f"{name}:{number}: `python -m {module} {' '.join(args)}`: no benchmark '{args[0]}'; "
                f"choose one of: {', '.join(names())}"
            )
    return errors


# ---- the checks on this repository ----


def test_every_page_is_within_its_length():
    assert not check_length(ROOT, PENDING), "\n".join(check_length(ROOT, PENDING))


def test_no_dated_history_outside_the_changelog():
    assert not check_dates(ROOT, PENDING), "\n".join(check_dates(ROOT, PENDING))


def test_the_pending_list_names_only_pages_that_still_need_it():
    failing = {e.split(":")[0] for e in check_length(ROOT) + check_dates(ROOT)}
    done = sorted(PENDING - failing)
    assert not done, f"these pages now pass: remove them from PENDING in tests/unit/test_docs.py: {done}"


def test_no_dead_relative_link():
    assert not check_links(ROOT), "\n".join(check_links(ROOT))


def test_every_listed_term_is_defined_and_linked():
    assert not check_terms(ROOT), "\n".join(check_terms(ROOT))


def test_pages_open_with_commands_and_the_readme_links_every_page():
    assert not check_openings(ROOT), "\n".join(check_openings(ROOT))


def test_every_documented_command_composes():
    commands = documented_commands(ROOT)
    assert len(commands) > 20  # the extraction finds the docs' commands
    assert not check_commands(ROOT), "\n".join(check_commands(ROOT))


# ---- each check fails on a planted bad page ----


@pytest.fixture
def site(tmp_path):
    """A minimal compliant repository: README, a glossary defining every term, one page."""
    (tmp_path / "docs").mkdir()
    headings = "\n\n".join(f"## {key.replace('-', ' ')}\n\nwhat it means." for key in TERMS)
    (tmp_path / "docs" / "glossary.md").write_text(f"# Glossary\n\n{headings}\n")
    page = "# Page\n\n```bash\nmake demo\n```\n\n## Section one\n\nSee [Ψ](glossary.md#psi).\n"
    (tmp_path / "docs" / "page.md").write_text(page)
    (tmp_path / "README.md").write_text(
        "# Readme\n\n```bash\nmake demo   # the table\nmake test\n```\n\n"
        "[page](docs/page.md#section-one), [terms](docs/glossary.md)\n"
    )
    return tmp_path


def test_a_compliant_site_passes(site):
    assert {"psi", "noise-floor", "held-out"} <= anchors(site / "docs" / "glossary.md")
    checks = (check_length, check_dates, check_links, check_terms, check_commands, check_openings)
    assert not [e for check in checks for e in check(site)]


def test_a_page_over_the_limit_fails(site):
    assert not check_length(site)
    (site / "docs" / "page.md").write_text("x\n" * (PAGE_LIMIT + 1))
    (site / "README.md").write_text("x\n" * (README_LIMIT + 1))
    errors = check_length(site)
    assert len(errors) == 2 and "docs/page.md: 301 lines" in errors[1] and "README.md: 151" in errors[0]
    assert not check_length(site, {"docs/page.md", "README.md"})


@pytest.mark.parametrize(
    "line, bad",
    [
        ("Measured on 2026-11-27 on the Xeon.", True),
        ("The run at 10:55 took 462 s.", True),
        ("saved as plantime_cpu_20261127T0553.json", True),
        ("See `benchmarks/results/plantime_cpu_20261127T0553.json`.", False),
        ("[the run](../benchmarks/results/plantime_cpu_20261127T0553.json)", False),
        ("`make test` took 462 s on 2 cores.", False),
        ("a ratio of 1.5:1 and the slice x[0:10]", False),
        ("`trainer.steps=3` at `10:55` inside code", False),
        ("Today's default model is the cnn.", True),
        ("Measured in this session at load 5.", True),
        ("a file whose creator no longer runs", False),
    ],
)
def test_a_dated_line_fails(site, line, bad):
    (site / "docs" / "page.md").write_text(f"# Page\n\n{line}\n\n[Ψ](glossary.md#psi)\n")
    errors = check_dates(site)
    assert bool(errors) == bad, errors
    if bad:
        assert errors[0].startswith("docs/page.md:3: dated line") and "CHANGELOG.md" in errors[0]


def test_a_page_without_a_command_or_unlinked_from_the_readme_fails(site):
    assert not check_openings(site), check_openings(site)
    (site / "docs" / "new.md").write_text("# New\n\n" + "prose\n" * COMMAND_WITHIN + "```bash\nmake demo\n```\n")
    readme = site / "README.md"
    readme.write_text(readme.read_text().replace("make test\n", "make test\npython -m parallel_lab\n"))
    errors = check_openings(site)
    assert errors[0].startswith("docs/new.md: no command block in its first 15 lines"), errors
    assert "exactly two commands" in errors[1] and "README.md: does not link docs/new.md" in errors[2]
    assert len(errors) == 3


def test_a_dead_link_or_anchor_fails(site):
    assert not check_links(site), check_links(site)
    page = site / "docs" / "page.md"
    page.write_text(page.read_text() + "[gone](missing.md) [bad](glossary.md#no-such-term) [self](#section-one)\n")
    errors = check_links(site)
    assert len(errors) == 2, errors
    assert "dead link 'missing.md'" in errors[0] and "dead anchor 'glossary.md#no-such-term'" in errors[1]
    (site / "benchmarks" / "results").mkdir(parents=True)
    (site / "benchmarks" / "results" / "run.md").write_text(
        "# Run\n\n[page](../../docs/page.md) [gone](../../docs/gone.md)\n"
    )
    errors = check_links(site)
    assert len(errors) == 3 and errors[2].startswith("benchmarks/results/run.md:3: dead link '../../docs/gone.md'"), (
        errors
    )


def test_a_term_undefined_or_unlinked_fails(site):
    assert not check_terms(site), check_terms(site)
    (site / "docs" / "other.md").write_text("# Other\n\nThe MFU of a run.\n")
    glossary = site / "docs" / "glossary.md"
    glossary.write_text(glossary.read_text().replace("## busbw", "## bus bandwidth"))
    errors = check_terms(site)
    assert any("'busbw' is not defined" in e for e in errors), errors
    assert any(e.startswith("docs/other.md: uses mfu but never links the glossary") for e in errors), errors
    assert len(errors) == 2
    (site / "docs" / "other.md").write_text("# Other\n\n[Ψ](glossary.md#psi) = 321,290 parameters; Ψ = 4n bytes.\n")
    (site / "docs" / "third.md").write_text("# Third\n\n[model](glossary.md#psi) of Ψ = 7.5 B parameters.\n")
    errors = check_terms(site)
    assert sum("Ψ used as a parameter count" in e for e in errors) == 2, errors
    assert any(e.startswith("docs/other.md:3:") for e in errors) and any(
        e.startswith("docs/third.md:3:") for e in errors
    )


def test_a_command_hydra_cannot_compose_fails(site):
    page = site / "docs" / "page.md"
    good = "```bash\npython -m parallel_lab strategy=ddp trainer.steps=3   # fine\n```\n"
    page.write_text(page.read_text() + good + "and `python -m parallel_lab.plan model=vit world_size=4`\n")
    assert len(documented_commands(site)) == 2 and not check_commands(site), check_commands(site)
    page.write_text(
        page.read_text()
        + "```bash\npython -m parallel_lab -m strategy=ddp,nope \\\n    trainer.steps=3\n"
        + "python -m parallel_lab trainer.stesp=3\n```\n"
        + "`python -m parallel_lab.plan trainer.steps=abc` and `python -m parallel_lab.bench nope`\n"
        + "a pattern: `python -m parallel_lab.bench <name> [args]`\n"
    )
    errors = check_commands(site)
    assert len(errors) == 4, errors
    assert "page.md:15:" in errors[0] and "unknown strategy 'nope'" in errors[0]
    assert "page.md:17:" in errors[1] and "stesp" in errors[1]
    assert "trainer.steps" in errors[2] and "no benchmark 'nope'" in errors[3]
