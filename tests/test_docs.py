"""The README and the guides in docs/: every relative link and picture resolves, every command of the
trainers parses with values in range, and every --flag they name exists. The lab's pages get the same
checks in lab/tests/test_pages.py, with these helpers."""

import glob
import os
import re
import shlex

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]  # the guides
LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)


def missing_links(page):
    """The relative links and pictures of a page whose target does not exist."""
    return [t for t in relative_links(page)
            if not os.path.exists(os.path.normpath(os.path.join(os.path.dirname(page), t.split("#")[0])))]


def relative_links(page):
    with open(page) as f:
        return [t for t in LINK.findall(f.read()) if "://" not in t and not t.startswith("#")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(page):
    missing = missing_links(page)
    assert not missing, f"{os.path.relpath(page, ROOT)} links to missing {missing}"


def test_the_link_check_sees_links():
    """The check above would pass vacuously if the pattern found nothing."""
    assert len(relative_links(os.path.join(ROOT, "README.md"))) >= 5
    assert len(PAGES) >= 4


PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9]*(_[A-Z0-9]+)+$", re.M)  # a line like FILL_ME_IN, left in a draft


def placeholders(text):
    return [m.group(0) for m in PLACEHOLDER.finditer(text)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_no_page_keeps_a_placeholder(page):
    with open(page) as f:
        left = placeholders(f.read())
    assert not left, f"{os.path.relpath(page, ROOT)} still holds {left}"


def test_the_placeholder_check_sees_one():
    assert placeholders("## Which to pick\n\nWHICH_TO_PICK\n") == ["WHICH_TO_PICK"]
    assert placeholders("`CI=true bash .ci/run`\nOMP_NUM_THREADS=1 python x.py\n") == []


def script_commands(text, script):
    """The arguments of each `script` command in a text, up to a backtick, a comment, a pipe or the
    line's end (a shell variable is dropped with the flag it is the value of)."""
    commands = []
    for match in re.findall(script.replace(".", r"\.") + r"(?=[\s`]|$)([^`#|>\n]*)", text):
        try:
            words = shlex.split(match.replace("\\", " "))
        except ValueError:  # an unbalanced quote: prose, not a command
            continue
        if words and not words[0].startswith("-"):  # "train_toy.py defaults, ..." in a sentence
            continue
        args = []
        for arg in words:
            if "$" not in arg and not arg.startswith(("[", "...", "…")) and not arg.endswith("]"):
                args.append(arg)
            elif args and args[-1].startswith("--"):
                args.pop()
        commands.append(args)
    return commands


def parses(script, args, parse=None):
    """Raises SystemExit unless args are the script's flags with values in their declared ranges (checked
    by its own parse_args). parse: the checking parser of a script other than the two trainers (the lab's)."""
    if parse is None and script == "train_sd.py":
        import train_sd

        train_sd.parse_args(args)
        return
    import train_toy

    args = [*args, "--out", os.path.join(ROOT, "runs", "never-written")]
    if "--base-ckpt" in args:  # a file the commands' script writes first
        del args[args.index("--base-ckpt") : args.index("--base-ckpt") + 2]
    (parse or train_toy.parse_args)(args)


def check_commands(pages, script, parse=None):
    """Every script command in the pages parses (AssertionError naming the page if not); returns
    how many there were. parse: as parses'."""
    found = 0
    for page in pages:
        with open(page) as f:
            text = f.read()
        commands = script_commands(text, script)
        if script == "toy_options.py" and page.endswith("toy_quality.sh"):
            commands += [shlex.split(m) for m in re.findall(r'"\w+\|([^"]*)"', text)]
        for args in commands:
            if "--help" not in args:
                try:
                    parses(script, args, parse)
                except SystemExit as e:
                    raise AssertionError(f"{os.path.relpath(page, ROOT)}: {script} {' '.join(args)}: {e}") from None
        found += len(commands)
    return found


@pytest.mark.parametrize("script", ["train_toy.py", "train_sd.py"])
def test_script_commands_in_the_pages_parse(script):
    """A command a reader copies runs: every train_toy.py and train_sd.py command in the README and
    docs/ uses flags that exist, with values in range: a renamed flag fails here, not at the
    reader's."""
    pytest.importorskip("diffusers", reason="the optional extra: pip install -e '.[sd]'")
    found = check_commands(PAGES, script)
    assert found >= 1, f"no {script} command found: the pattern sees nothing"


def test_the_command_check_sees_bad_flags():
    """The check above would pass vacuously if the pattern found nothing or parse accepted anything."""
    assert script_commands("`python train_toy.py --steps 80 --out $dir` and torchrun x train_toy.py --window 1 # W",
                           "train_toy.py") == [["--steps", "80"], ["--window", "1"]]
    for args in (["--steps", "80"], ["--window", "1"], ["--anchors", "shared"]):
        with pytest.raises(SystemExit):
            parses("train_toy.py", args)
    pytest.importorskip("diffusers", reason="the optional extra: pip install -e '.[sd]'")
    for args in (["--window", "1"], ["--epochs", "0"], ["--no-such-flag"]):
        with pytest.raises(SystemExit):
            parses("train_sd.py", args)


# Flags of other programs the pages quote (torchrun, pip, pytest).
OTHER_TOOLS = {"--nproc_per_node", "--standalone", "--nnodes", "--index-url", "--no-deps", "--target", "--durations",
               "--only-binary"}


def flags_of(path):
    """The flags a script's argparse parser takes (read from its source: add_argument("--x"), and a
    dataclass's fields for the trainers), with --no-x for the booleans."""
    with open(path) as f:
        text = f.read()
    flags = set(re.findall(r'add_argument\(\s*"(--[a-z][\w-]*)"', text))
    if "@dataclass" in text:  # a parser built from a dataclass's fields: a flag each
        flags |= {"--" + f.replace("_", "-") for f in re.findall(r"^    (\w+): \w+ = ", text, re.M)}
        flags |= {"--no-" + f.replace("_", "-") for f in re.findall(r"^    (\w+): bool = ", text, re.M)}
    return flags


def known_flags(lab):
    scripts = ["train_toy.py", "train_sd.py", "examples/your_model.py"]
    if lab:
        scripts += sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "lab", "*.py")))
    flags = set(OTHER_TOOLS) | {"--help"}
    for script in scripts:
        flags |= flags_of(os.path.join(ROOT, script))
    return flags


def prose_flags(text, lab=False):
    """Every --flag inside a `code span` of a page (commands and flags named in sentences alike), but
    those of a span that names a lab/ script unless lab (they are checked against lab's flags)."""
    spans = [s for s in re.findall(r"`([^`\n]+)`", text) if lab == ("lab/" in s)]
    return {flag for span in spans for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", span)}


def unknown_flags(page, lab_page=False):
    """The `--flag`s a page names that no script has (of lab/'s scripts too on a lab page)."""
    with open(page) as f:
        text = f.read()
    if page.endswith(".py"):  # a script's comments name flags without backticks
        text = "`" + "` `".join(re.findall(r"#.*", text)) + "`"
    unknown = prose_flags(text) - known_flags(lab=lab_page)
    unknown |= prose_flags(text, lab=True) - known_flags(lab=True)
    return unknown


@pytest.mark.parametrize("page", PAGES + [os.path.join(ROOT, "examples", "your_model.py")],
                         ids=lambda p: os.path.relpath(p, ROOT))
def test_every_flag_a_page_names_exists(page):
    """A flag named in prose (`--cfg-grad`, say) goes stale when the script drops it, and no command
    parses it: every `--flag` in a code span names a flag of the repository's scripts, or of
    torchrun, pip or pytest."""
    unknown = unknown_flags(page)
    assert not unknown, f"{os.path.relpath(page, ROOT)} names flags no script has: {sorted(unknown)}"


def test_the_flag_check_sees_stale_flags():
    assert prose_flags("run `train_sd.py --cfg-grad cond` or `--window 4`; not -- nor --x in prose") == {
        "--cfg-grad", "--window"}
    assert "--window" in known_flags(lab=False) and "--no-ema" in known_flags(lab=False)
    assert "--cfg-grad" not in known_flags(lab=False) and "--jagg-frac" in known_flags(lab=False)
    assert "--anchors" not in known_flags(lab=False) and "--anchors" in known_flags(lab=True)  # the lab's option
    assert "--full-finetune" in known_flags(lab=True) and "--exact-from" not in known_flags(lab=True)
