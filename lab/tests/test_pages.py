"""The lab's pages (lab/README.md, lab/reports/) and its scripts lab/*.sh: tests/test_docs.py's checks
of the guides, on the evidence. Links and pictures resolve, every trainer command parses, every
--flag named exists."""

import glob
import os

import pytest

import sd_runner  # lab/ is on the path (lab/tests/conftest.py)
import toy_options
from tests.test_docs import ROOT, check_commands, missing_links, parses, placeholders, unknown_flags

LAB_PAGES = [os.path.join(ROOT, "lab", "README.md"), *sorted(glob.glob(os.path.join(ROOT, "lab", "reports", "*.md")))]
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "lab", "*.sh")))


def test_there_are_pages_to_check():
    assert len(LAB_PAGES) >= 5 and len(SCRIPTS) >= 3


@pytest.mark.parametrize("page", LAB_PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(page):
    missing = missing_links(page)
    assert not missing, f"{os.path.relpath(page, ROOT)} links to missing {missing}"


@pytest.mark.parametrize("page", LAB_PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_no_page_keeps_a_placeholder(page):
    with open(page) as f:
        left = placeholders(f.read())
    assert not left, f"{os.path.relpath(page, ROOT)} still holds {left}"


def runner_parses(args):
    """SystemExit unless args are lab/sd_runner.py's flags with values in their declared ranges."""
    cfg = sd_runner.parse(args)
    bad = [flag for ok, flag, _ in cfg.ranges() if not ok]
    if bad:
        raise SystemExit(f"error: --{bad[0]} out of range")
    try:
        sd_runner.options.check_options(cfg.jagg_options())
    except ValueError as e:
        raise SystemExit(f"error: {e}")


PARSERS = {"train_toy.py": None, "toy_options.py": toy_options.parse_args, "lab/sd_runner.py": runner_parses}


@pytest.mark.parametrize("script", PARSERS)
def test_script_commands_in_the_pages_parse(script):
    """Every train_toy.py, lab/toy_options.py and lab/sd_runner.py command of lab/'s pages and lab/*.sh
    (and lab/toy_quality.sh's modes) parses with values in range."""
    pytest.importorskip("diffusers", reason="the optional extra: pip install -e '.[sd]'")
    found = check_commands(LAB_PAGES + SCRIPTS, script, PARSERS[script])
    assert found >= 3, f"only {found} {script} commands found: the pattern sees nothing"


def test_the_command_check_sees_the_options_flags():
    """The check above would pass vacuously if toy_options' parser accepted anything."""
    parses("toy_options.py", ["--anchors", "shared"], toy_options.parse_args)
    with pytest.raises(SystemExit):
        parses("toy_options.py", ["--anchors", "nowhere"], toy_options.parse_args)


@pytest.mark.parametrize("page", LAB_PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_flag_a_page_names_exists(page):
    unknown = unknown_flags(page, lab_page=True)
    assert not unknown, f"{os.path.relpath(page, ROOT)} names flags no script has: {sorted(unknown)}"
