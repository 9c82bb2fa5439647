"""The documentation cannot drift: docs/spec.md names every key of the spec's JSON Schema, every
relative link in README.md and docs/*.md points at a file (and a heading) that exists, and the README
stays a short front page with the two set-up commands unchanged."""

import re
from pathlib import Path

from launcher.spec.cluster import spec_schema

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
# [text](target "title") and ![alt](target); text may hold one level of brackets
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$", re.M)
HTML_LINK = re.compile(r"<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*[\"']([^\"']+)[\"']", re.I)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")  # http:, https:, mailto:, ...
HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)


def schema_keys(node, where="ClusterSpec", found=None) -> dict[str, set[str]]:
    """{property name: the models that define it}, from every `properties` table of the schema: the
    top level's, every `$defs` entry's, and any nested deeper."""
    found = {} if found is None else found
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "properties" and isinstance(value, dict):
                for name, sub in value.items():
                    found.setdefault(name, set()).add(where)
                    schema_keys(sub, f"{where}.{name}", found)
            elif key == "$defs" and isinstance(value, dict):
                for name, sub in value.items():
                    schema_keys(sub, name, found)
            else:
                schema_keys(value, where, found)
    elif isinstance(node, list):
        for item in node:
            schema_keys(item, where, found)
    return found


def prose(text: str) -> str:
    """The page without fenced code blocks and inline code spans (links in code are not links)."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def links(text: str) -> list[str]:
    body = prose(text)
    return LINK.findall(body) + REF_DEF.findall(body) + HTML_LINK.findall(body)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text without markup, lower-cased, every character that is not
    a letter, digit, underscore, hyphen or space dropped, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's or image's text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor on `page`; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_spec_page_names_every_schema_key():
    keys = schema_keys(spec_schema())
    assert {"hosts", "slurm", "kubernetes", "training", "launch", "sync"} <= set(keys)  # the walk works
    page = (DOCS / "spec.md").read_text(encoding="utf-8")
    missing = sorted(f"`{name}` (in {', '.join(sorted(where))})" for name, where in keys.items()
                     if f"`{name}`" not in page)
    assert not missing, "docs/spec.md does not name these keys of the schema (as `key`):\n  " + "\n  ".join(missing)


def test_every_relative_link_resolves():
    assert (REPO / "README.md").exists() and (DOCS / "spec.md").exists()
    broken = []
    checked = 0
    for page in PAGES:
        for target in links(page.read_text(encoding="utf-8")):
            if not target or SCHEME.match(target):
                continue  # http(s), mailto: not ours to check
            checked += 1
            path, _, anchor = target.partition("#")
            where = f"{page.relative_to(REPO)}: ({target})"
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{where}: {dest.relative_to(REPO) if dest.is_relative_to(REPO) else dest} "
                              "does not exist")
                continue
            if anchor:
                if dest.suffix != ".md":
                    broken.append(f"{where}: an anchor into {dest.name}, which is not a Markdown page")
                elif anchor not in anchors(dest):
                    broken.append(f"{where}: no heading of {dest.relative_to(REPO)} has the anchor #{anchor} "
                                  f"(it has: {', '.join(sorted(anchors(dest)))})")
    assert checked > 10, f"only {checked} relative links found: is the link pattern still right?"
    assert not broken, "broken links:\n  " + "\n  ".join(broken)


def test_readme_is_a_short_front_page_with_the_setup_commands():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 150, (f"README.md has {len(lines)} lines; keep it a front page (at most 150) and move "
                               "the detail to docs/")
    for command in ("    pip install -e '.[examples]' && mgpu-cluster up cluster.example.toml",
                    "    apt-get install -y openssh-server iproute2 slurmctld slurmd slurm-client chromium && "
                    "pip install -e '.[test]' && python3 -m pytest -q"):
        assert command in lines, f"README.md lost its set-up command, byte for byte:\n{command}"
    unlinked = [p.name for p in sorted(DOCS.glob("*.md")) if f"(docs/{p.name})" not in text]
    assert not unlinked, f"pages in docs/ that README.md does not link: {unlinked}"


def test_slug_follows_github():
    assert slug("The entrypoint contract") == "the-entrypoint-contract"
    assert slug("`status --json`") == "status---json"
    assert slug("progress.json") == "progressjson"
    assert slug("Stuck or slow: stacks, stragglers, report") == "stuck-or-slow-stacks-stragglers-report"
    assert slug("Elastic runs (`min_hosts`)") == "elastic-runs-min_hosts"
    assert slug("[Link](x.md) text") == "link-text"
