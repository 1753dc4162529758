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


def script_commands(text, script):
    """The arguments of each `script` command in a text (train_toy.py or train_sd.py), up to a backtick, a comment,
    a pipe or the line's end (a shell variable is dropped with the flag it is the value of)."""
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


def parses(script, args):
    """Raises SystemExit unless args are the script's flags with values in their declared ranges."""
    if script in ("train_toy.py", "toy_options.py"):
        import train_toy

        parse = toy_options().parse_args if script == "toy_options.py" else train_toy.parse_args
        args = [*args, "--out", os.path.join(ROOT, "runs", "never-written")]
        if "--base-ckpt" in args:  # a file a script writes first
            del args[args.index("--base-ckpt") : args.index("--base-ckpt") + 2]
        parse(args)
        return
    import jagg_options
    import train_sd

    cfg = train_sd.parse(args)
    bad = [flag for ok, flag, _ in cfg.ranges() if not ok]
    if bad:
        raise SystemExit(f"error: --{bad[0]} out of range")
    try:
        jagg_options.check_options(cfg.jagg_options())
    except ValueError as e:
        raise SystemExit(f"error: {e}")


COMMAND_PAGES = [*PAGES, os.path.join(ROOT, "lab", "README.md"), *sorted(glob.glob(os.path.join(ROOT, "lab", "*.sh")))]


def toy_options():
    import importlib.util

    spec = importlib.util.spec_from_file_location("toy_options", os.path.join(ROOT, "examples", "toy_options.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("script", ["train_toy.py", "toy_options.py", "train_sd.py"])
def test_script_commands_in_the_readme_docs_and_lab_parse(script):
    """A command a reader copies runs: every train_toy.py / train_sd.py command in the README, docs/, lab/README.md
    and lab/*.sh (and lab/toy_quality.sh's modes) uses flags that exist, with values in range: a renamed flag (the
    toy's --steps -> --epochs) fails here, not at the reader's."""
    if script == "train_sd.py":
        pytest.importorskip("diffusers", reason="the optional extra: pip install -e '.[sd]'")
    found = 0
    for page in COMMAND_PAGES:
        with open(page) as f:
            text = f.read()
        commands = script_commands(text, script)
        if script == "toy_options.py" and page.endswith("toy_quality.sh"):
            commands += [shlex.split(m) for m in re.findall(r'"\w+\|([^"]*)"', text)]
        for args in commands:
            if "--help" not in args:
                try:
                    parses(script, args)
                except SystemExit as e:
                    raise AssertionError(f"{os.path.relpath(page, ROOT)}: {script} {' '.join(args)}: {e}") from None
        found += len(commands)
    assert found >= 3, f"only {found} {script} commands found: the pattern sees nothing"


def test_the_command_check_sees_bad_flags():
    """The check above would pass vacuously if the pattern found nothing or parse accepted anything."""
    assert script_commands("`python train_toy.py --steps 80 --out $dir` and torchrun x train_toy.py --window 1 # W",
                           "train_toy.py") == [["--steps", "80"], ["--window", "1"]]
    for args in (["--steps", "80"], ["--window", "1"]):
        with pytest.raises(SystemExit):
            parses("train_toy.py", args)
    pytest.importorskip("diffusers", reason="the optional extra: pip install -e '.[sd]'")
    for args in (["--window", "1"], ["--epochs", "0"], ["--no-such-flag"]):
        with pytest.raises(SystemExit):
            parses("train_sd.py", args)
