"""README.md's in-page links (its contents line among them) lead to headings that exist."""

from __future__ import annotations

import re

from support import REPO_ROOT


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation other than `-` and `_`
    dropped, spaces as `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_github_anchor_follows_githubs_rule():
    assert github_anchor("Real checkpoints (Hugging Face)") == "real-checkpoints-hugging-face"
    assert github_anchor("The learner's execution knobs") == "the-learners-execution-knobs"
    assert (
        github_anchor("GSM8K (math), `configs/gsm8k_rho1b.py`") == "gsm8k-math-configsgsm8k_rho1bpy"
    )


def test_every_in_page_link_names_a_heading():
    text = (REPO_ROOT / "README.md").read_text()
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)  # a `# comment` is no heading
    anchors = {github_anchor(title) for title in re.findall(r"^#+ (.*)$", prose, re.M)}
    links = re.findall(r"\]\(#([^)]+)\)", text)
    assert len(links) >= 20  # the contents line
    assert [link for link in links if link not in anchors] == []
