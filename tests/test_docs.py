"""The documentation against the code: docs/api.md documents every public callable with its
current signature (and no stale one), and every relative link of the repository's Markdown files
points at a file inside the repository."""
import inspect
import re
import subprocess
import urllib.parse
from pathlib import Path

import pytest

import rmsnorm_hip
from rmsnorm_hip import reference

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parent.parent
API_MD = ROOT / "docs" / "api.md"


# ---- public callables and their signatures ------------------------------------------------------

def _torch_adapter():
    """rmsnorm_hip.torch, or None when torch is not installed."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    from rmsnorm_hip import torch as adapter
    return adapter


def signature_line(name, obj):
    """How docs/api.md writes ``obj``'s signature: ``name(args)``, a class by its ``__init__``
    without ``self``."""
    if inspect.isclass(obj):
        sig = inspect.signature(obj.__init__)
        sig = sig.replace(parameters=list(sig.parameters.values())[1:])
    else:
        sig = inspect.signature(obj)
    return f"{name}{sig}"


def _reference_functions():
    return [n for n, obj in vars(reference).items()
            if not n.startswith("_") and inspect.isfunction(obj)
            and obj.__module__ == reference.__name__]


def public_callables():
    """{module name: {name: object}} of every public callable the reference covers."""
    modules = {
        "rmsnorm_hip": {n: getattr(rmsnorm_hip, n) for n in rmsnorm_hip.__all__},
        "rmsnorm_hip.reference": {n: getattr(reference, n) for n in _reference_functions()},
    }
    adapter = _torch_adapter()
    if adapter is not None:
        modules["rmsnorm_hip.torch"] = {n: getattr(adapter, n) for n in adapter.__all__}
    return {mod: {n: o for n, o in names.items() if callable(o)} for mod, names in modules.items()}


# ---- docs/api.md, parsed ------------------------------------------------------------------------

_MODULE_HEADING = re.compile(r"^## Module `([\w.]+)`\s*$")


def documented_entries(text):
    """[(module or None, heading name, first line of the first python block under it, or None)]
    for every ``### `` heading of ``text``.  The module is the enclosing ``## Module `name```
    section's (None outside one); the block must come before the next heading."""
    entries, module, current = [], None, None
    in_fence, fence_lang, block_first = False, "", None
    for line in text.splitlines():
        if line.startswith("```"):
            if not in_fence:
                in_fence, fence_lang, block_first = True, line[3:].strip(), None
            else:
                in_fence = False
                if current is not None and current[2] is None and fence_lang == "python":
                    current[2] = block_first
            continue
        if in_fence:
            if block_first is None and line.strip():
                block_first = line.strip()
            continue
        if line.startswith("## "):
            found = _MODULE_HEADING.match(line)
            module = found.group(1) if found else None
            current = None
        elif line.startswith("### "):
            current = [module, line[4:].strip(), None]
            entries.append(current)
        elif line.startswith("#"):
            current = None
    return [tuple(e) for e in entries]


@pytest.fixture(scope="module")
def api_text():
    assert API_MD.is_file(), "docs/api.md is missing"
    return API_MD.read_text(encoding="utf-8")


def _cases():
    return [(mod, name) for mod, names in public_callables().items() for name in names]


@pytest.mark.parametrize("module,name", _cases(), ids=lambda v: v)
def test_every_public_callable_is_documented(api_text, module, name):
    obj = public_callables()[module][name]
    expected = signature_line(name, obj)
    entries = [e for e in documented_entries(api_text) if e[0] == module and e[1] == name]
    assert entries, (f"docs/api.md has no '### {name}' heading in its '## Module `{module}`' "
                     f"section")
    assert f"### {name}" in api_text.splitlines()
    assert expected in (line.strip() for line in api_text.splitlines()), (
        f"docs/api.md lacks the signature line {expected!r}")
    assert entries[0][2] == expected, (
        f"'### {name}' ({module}) is followed by {entries[0][2]!r}, not {expected!r}")


def test_no_documented_signature_is_stale(api_text):
    """Every ``### name`` heading that names a public callable of its section's module (the top
    level outside a module section) carries that callable's current signature."""
    callables = public_callables()
    stale = []
    for module, name, first_line in documented_entries(api_text):
        known = callables.get(module or "rmsnorm_hip")
        if known is None or name not in known:
            continue
        expected = signature_line(name, known[name])
        if first_line != expected:
            stale.append(f"### {name} ({module}): {first_line!r} != {expected!r}")
    assert not stale, "stale signatures in docs/api.md:\n" + "\n".join(stale)


def test_module_sections_exist(api_text):
    headings = {m.group(1) for m in map(_MODULE_HEADING.match, api_text.splitlines()) if m}
    assert set(public_callables()) <= headings


def test_signature_parser_sees_headings_and_blocks():
    text = ("## Module `a.b`\n\n### f\n\ntext\n\n```python\nf(x)\n```\n\n### g\n\n"
            "```bash\ng --x\n```\n\n## Other\n\n### h\n\n```python\n\nh()\n```\n")
    assert documented_entries(text) == [("a.b", "f", "f(x)"), ("a.b", "g", None),
                                        (None, "h", "h()")]


def test_class_signature_drops_self():
    class Thing:
        def __init__(self, a, b=1, *, c=None):
            pass
    assert signature_line("Thing", Thing) == "Thing(a, b=1, *, c=None)"


# ---- relative links of the Markdown files -------------------------------------------------------

_SKIP_DIRS = {".git", ".venv", "node_modules", "build", "dist"}


def markdown_files():
    """The repository's Markdown files: tracked, plus untracked ones git does not ignore."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                              "-z", "--", "*.md"], cwd=ROOT, capture_output=True, check=True)
        paths = [ROOT / p for p in out.stdout.decode().split("\0") if p]
    except (OSError, subprocess.CalledProcessError):
        paths = [p for p in ROOT.rglob("*.md")
                 if not any(part in _SKIP_DIRS or part.endswith((".egg-info", ".whl"))
                            for part in p.relative_to(ROOT).parts)]
    return sorted(p for p in paths if p.is_file())


_FENCE = re.compile(r"^([ \t]*)(`{3,}|~{3,}).*?^\1\2[`~]*[ \t]*$", re.DOTALL | re.MULTILINE)
_CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.DOTALL)
# the "](target)" that closes a link's or an image's text (nested ones included)
_INLINE_LINK = re.compile(r"\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
_REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)", re.MULTILINE)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def link_targets(text):
    """The targets of the inline links / images and link definitions of Markdown ``text``,
    outside code blocks and code spans."""
    text = _CODE_SPAN.sub("", _FENCE.sub("", text))
    targets = [m.group(1) for m in _INLINE_LINK.finditer(text)]
    targets += [m.group(1) for m in _REFERENCE_DEF.finditer(text)]
    return [t[1:-1] if t.startswith("<") and t.endswith(">") else t for t in targets]


def broken_links(path):
    """[(target, why)] of the relative links in ``path`` whose file does not exist inside the
    repository (the anchor of ``path#anchor`` is not checked)."""
    broken = []
    for target in link_targets(path.read_text(encoding="utf-8")):
        if not target or target.startswith("#") or _SCHEME.match(target):
            continue            # http(s)://, mailto:, other schemes, and anchors in the page
        file_part = urllib.parse.unquote(target.split("#", 1)[0].split("?", 1)[0])
        if not file_part:
            continue
        base = ROOT if file_part.startswith("/") else path.parent
        resolved = (base / file_part.lstrip("/")).resolve()
        if not resolved.is_relative_to(ROOT):
            broken.append((target, "outside the repository"))
        elif not resolved.exists():
            broken.append((target, "no such file"))
    return broken


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    broken = broken_links(path)
    assert not broken, (f"{path.relative_to(ROOT)}: broken relative links:\n"
                        + "\n".join(f"  {t} ({why})" for t, why in broken))


def test_link_parser(tmp_path):
    text = ("[a](x.md) ![img](pics/p.png \"title\") [b](<with space.md#sec>) [c](#anchor)\n"
            "[d](https://example.com) [e](mailto:a@b.c) `[f](in_code.md)`\n"
            "```\n[g](in_fence.md)\n```\n[h]: defs/ref.md\n[i]([nested].md)\n")
    assert link_targets(text) == ["x.md", "pics/p.png", "with space.md#sec", "#anchor",
                                  "https://example.com", "mailto:a@b.c", "[nested].md",
                                  "defs/ref.md"]


def heading_slugs(text):
    """GitHub's anchors of the headings of Markdown ``text`` (lower case, punctuation but ``-``
    and ``_`` dropped, spaces to ``-``; a repeated slug gets ``-1``, ``-2``, ...)."""
    seen, slugs = {}, set()
    for line in _FENCE.sub("", text).splitlines():
        found = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not found:
            continue
        slug = re.sub(r"[^\w\- ]", "", found.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        slugs.add(slug if count == 0 else f"{slug}-{count}")
    return slugs


@pytest.mark.parametrize("path", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_in_page_anchors_of_docs_resolve(path):
    text = path.read_text(encoding="utf-8")
    slugs = heading_slugs(text)
    missing = [t for t in link_targets(text) if t.startswith("#") and t[1:] not in slugs]
    assert not missing, f"docs/{path.name}: anchors with no heading: {missing}"


def test_heading_slugs():
    text = "# API\n## Module `rmsnorm_hip.torch`\n### rms_norm\n### rms_norm\n## Outputs, `out=`\n"
    assert heading_slugs(text) == {"api", "module-rmsnorm_hiptorch", "rms_norm", "rms_norm-1",
                                   "outputs-out"}
