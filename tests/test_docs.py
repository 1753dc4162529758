"""The README and the docs/ pages: every relative link and picture resolves to a file in the repository."""

import glob
import os
import re
import shlex

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)


def relative_links(page):
    with open(page) as f:
        targets = LINK.findall(f.read())
    return [t.split("#")[0] for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(page):
    links = relative_links(page)
    missing = [t for t in links if not os.path.exists(os.path.join(os.path.dirname(page), t))]
    assert not missing, f"{os.path.relpath(page, ROOT)} links to files that do not exist: {missing}"


def test_the_link_check_sees_links():
    """The check above would pass vacuously if the pattern found nothing."""
    assert len(relative_links(os.path.join(ROOT, "README.md"))) >= 5
    assert len(PAGES) >= 5


def toy_commands(text):
    """The arguments of each train_toy.py command in a text, up to a backtick, a comment, a pipe or the line's end
    (a shell variable is dropped with the flag it is the value of)."""
    commands = []
    for match in re.findall(r"train_toy\.py(?=[\s`]|$)([^`#|>\n]*)", text):
        args = []
        for arg in shlex.split(match):
            if "$" not in arg:
                args.append(arg)
            elif args and args[-1].startswith("--"):
                args.pop()
        commands.append(args)
    return commands


@pytest.mark.parametrize("page", [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "lab", "*.sh"))],
                         ids=lambda p: os.path.relpath(p, ROOT))
def test_toy_commands_in_the_readme_and_the_lab_parse(page):
    """A command a reader copies runs: every train_toy.py command (and lab/toy_quality.sh's modes) uses flags that
    exist, with values in range (a renamed flag such as --steps -> --epochs fails here, not at the reader's)."""
    import train_toy

    with open(page) as f:
        text = f.read()
    commands = toy_commands(text) + [shlex.split(m) for m in re.findall(r'"\w+\|([^"]*)"', text)]
    assert commands, f"no train_toy.py command in {page}"
    for args in commands:
        if "--help" not in args:
            train_toy.parse([*args, "--out", os.path.join(ROOT, "runs", "never-written")])  # raises SystemExit if not


def test_the_toy_command_check_sees_bad_flags():
    """The check above would pass vacuously if the pattern found nothing or parse accepted anything."""
    import train_toy

    assert toy_commands("`python train_toy.py --steps 80 --out $dir` and torchrun x train_toy.py --window 1 # W") == [
        ["--steps", "80"], ["--window", "1"]]
    for args in (["--steps", "80"], ["--window", "1"]):
        with pytest.raises(SystemExit):
            train_toy.parse(args)
