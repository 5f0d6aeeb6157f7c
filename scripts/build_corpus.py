"""Build the ``debian_docs`` corpus: English technical text from Debian packages, split into
train / validation, plus a byte-level BPE tokenizer trained on the train split.

    python scripts/build_corpus.py                       # apt-get download, write data/corpus/
    python scripts/build_corpus.py --debs DIR            # use the .deb files in DIR
    python scripts/build_corpus.py --keep-debs           # keep what apt-get downloaded (data/debs/)
    python scripts/build_corpus.py --out /tmp/c --vocab-size 8192

Why these packages: they install from Debian's archive (which the machines reach; nothing
else is downloaded), they are long-form English prose about software (the domain of the
people who train with this recipe), their licences allow redistribution and derived works,
and together they give ~67 MB of text, so a 3,000-step study reads each token at most once.

==================  ==========================================  =================================
package             what                                        licence (see licenses/<package>)
==================  ==========================================  =================================
linux-doc-6.1       Linux kernel Documentation/ (reST, text)    GPL-2 (some files GPL-2+/LGPL-2.1,
                                                                GFDL-1.1+, CC-BY-4.0: SPDX lines)
python3.11-doc      Python 3.11 documentation (reST sources)    PSF-2.0
perl-doc            Perl 5.36 manual (POD)                      GPL-1+ or Artistic
postgresql-doc-15   PostgreSQL 15 manual (HTML)                 PostgreSQL (BSD-like)
git-doc             Git manual pages and guides (AsciiDoc)      GPL-2
manpages            Linux man-pages, sections 1, 4-8 (roff)     Linux-man-pages-copyleft, GPL-2+
manpages-dev        Linux man-pages, sections 2-3 (roff)        Linux-man-pages-copyleft, GPL-2+
debian-handbook     The Debian Administrator's Handbook (HTML,  GPL-2.0+ or CC-BY-SA-3.0
                    en-US only)
debian-reference-en Debian Reference (HTML)                     GPL-2+
==================  ==========================================  =================================

Each package's Debian ``copyright`` file is copied to ``<out>/licenses/<package>``, and
``manifest.json`` records versions, licences, counts and sizes.

Processing, deterministic from the same .deb files:

1. One document per source file: HTML, roff and POD are turned into plain text (markup
   removed); reST and AsciiDoc are kept as written. In the HTML manuals, lines found in
   more than 90% of a package's pages (navigation bars, page footers) are dropped. Documents
   under 256 characters (stubs, ``.so`` links between man pages) are left out.
2. Exact duplicates (after whitespace normalisation) are removed, keeping the first in
   package order.
3. Split by content hash: a document goes to validation when the first 8 hex digits of its
   SHA-256, as an integer, mod 10,000 are below ``--val-permyriad`` (default 200 = 2 %).
   Adding or removing other documents never moves a document between splits.
4. Documents over 64 KiB are cut at paragraph boundaries into pieces (after the split, so
   a file's pieces stay in one split). Within a split, pieces are ordered by their hash: a
   fixed shuffle, so training does not see one package after another.
5. ``train.jsonl.gz`` and ``validation.jsonl.gz``: one ``{"text": ..., "source": package}``
   per line, gzip with a fixed timestamp (byte-identical outputs).
6. ``tokenizer/``: byte-level BPE (``tokenizers``) with ``--vocab-size`` ids, trained on the
   train split only; torchtitan's ``HuggingFaceTokenizer`` loads the folder.
7. ``manifest.json``: per split documents, characters, bytes and tokens; per package the
   Debian version it was built from, licence and counts; the output files with sizes and
   SHA-256, and ``sha256``, the corpus's own (``launch.titan.data.corpus_sha256``: of the files'
   names and digests), which the parity rows record beside the package versions.

The .deb files ``apt-get download`` fetched are removed once the corpus is built (``--keep-debs``
keeps them); .deb files that were in ``--debs`` before stay.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import html.parser
import importlib.util
import io
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from launch.titan.data import CORPUS_DATASET, CORPUS_DIR, CORPUS_FILES, corpus_sha256  # noqa: E402
from launch.titan.models import CORPUS_VOCAB_SIZE  # noqa: E402  (the parity flavors' vocab)

DEFAULT_OUT = CORPUS_DIR
DEFAULT_DEBS = REPO / "data" / "debs"  # outside the corpus folder, which travels to GPU machines
VOCAB_SIZE = CORPUS_VOCAB_SIZE
VAL_PERMYRIAD = 200
MIN_CHARS = 256
MAX_PIECE_CHARS = 64 * 1024



class CorpusError(RuntimeError):
    """A problem building the corpus that the user can fix (message says how)."""


# ------------------------------------------------------------------------------ extraction
def _read(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("latin-1")


def plain_text(raw: str) -> str:
    """reST, AsciiDoc and plain text: kept as written."""
    return raw


class _HTMLText(html.parser.HTMLParser):
    """Visible text of an HTML page; navigation blocks, scripts and styles left out."""

    BLOCK = {"p", "div", "br", "li", "ul", "ol", "dl", "dt", "dd", "tr", "table", "pre", "h1",
             "h2", "h3", "h4", "h5", "h6", "title", "section", "blockquote", "hr", "td", "th"}
    SKIP_TAGS = {"script", "style", "head", "nav"}
    SKIP_CLASSES = {"navheader", "navfooter", "toc", "related", "sphinxsidebar", "footer"}
    VOID = {"br", "hr", "img", "meta", "link", "input", "area", "base", "col", "wbr"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.stack: list[tuple[str, bool]] = []  # (tag, skipping from here)
        self.pre = 0

    def _skipping(self) -> bool:
        return any(skip for _, skip in self.stack)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        classes = set((dict(attrs).get("class") or "").split())
        if tag in self.BLOCK:
            self.parts.append("\n")
        if tag in self.VOID:
            return
        self.stack.append((tag, tag in self.SKIP_TAGS or bool(classes & self.SKIP_CLASSES)))
        if tag == "pre":
            self.pre += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in self.VOID:
            return
        while self.stack:  # tolerate unclosed tags
            open_tag, _ = self.stack.pop()
            if open_tag == "pre":
                self.pre -= 1
            if open_tag == tag:
                break
        if tag in self.BLOCK:
            self.parts.append("\n")

    def handle_data(self, data: str) -> None:
        if self._skipping():
            return
        self.parts.append(data if self.pre else re.sub(r"\s+", " ", data))


def html_text(raw: str) -> str:
    parser = _HTMLText()
    parser.feed(raw)
    parser.close()
    text = re.sub(r"\n (?=\S)", "\n", "".join(parser.parts))  # a collapsed space at line start
    return re.sub(r"\n[ \t]*\n[\s]*\n", "\n\n", text)  # one blank line between blocks


_ROFF_ESCAPES = [
    (re.compile(r"\\f(\[[^\]]*\]|\(..|.)"), ""),  # font changes
    (re.compile(r"\\\*?\((lq|rq|dq)"), '"'),
    (re.compile(r"\\\((aq|cq|oq)"), "'"),
    (re.compile(r"\\\(em"), "\u2014"),
    (re.compile(r"\\\(en"), "\u2013"),
    (re.compile(r"\\\(bu"), "\u2022"),
    (re.compile(r"\\\(co"), "\u00a9"),
    (re.compile(r"\\\(mu"), "\u00d7"),
    (re.compile(r"\\\[[^\]]*\]|\\\(..|\\\*\(..|\\\*."), ""),  # other named glyphs, strings
    (re.compile(r"\\[-]"), "-"),
    (re.compile(r"\\e"), "\\\\"),
    (re.compile(r"\\[&|^%:]"), ""),
    (re.compile(r"\\ "), " "),
    (re.compile(r"\\c$"), ""),
]
_ROFF_JOINED = {"BR", "RB", "IR", "RI", "BI", "IB"}  # alternating fonts, no spaces between
_ROFF_INLINE = {"B", "I", "SM", "SB", "UR", "MT", "Nm", "Nd", "Fl", "Ar", "Pa", "Xr", "Fn",
                "Ft", "Fa", "Dv", "Er", "Ev", "Li", "Cm", "Va", "Vt", "Sy", "Em", "Ql", "Dq", "Sq"}
_ROFF_HEADING = {"SH", "SS", "Sh", "Ss"}
_ROFF_BREAK = {"PP", "LP", "P", "sp", "br", "Pp", "TP", "TQ", "IP", "RS", "RE", "Bl", "El", "It"}
_ROFF_NOFILL = {"nf": True, "EX": True, "Bd": True, "fi": False, "EE": False, "Ed": False}


def _roff_args(rest: str) -> list[str]:
    return [a[1:-1] if a.startswith('"') and a.endswith('"') and len(a) > 1 else a
            for a in re.findall(r'"[^"]*"|\S+', rest)]


def _roff_escapes(line: str) -> str:
    for pattern, repl in _ROFF_ESCAPES:
        line = pattern.sub(repl, line)
    return line


def roff_text(raw: str) -> str:
    """Text of a man page (man/mdoc macros): filled paragraphs as a reader sees them,
    requests dropped, macro arguments kept, no-fill blocks (examples) kept line by line.
    A page that only points at another (``.so``) has no text of its own."""
    out: list[str] = []
    para: list[str] = []
    nofill = False

    def flush() -> None:
        if para:
            out.append(" ".join(para))
            para.clear()

    for line in raw.splitlines():
        if line.startswith(".so "):
            return ""
        if line.startswith(('.\\"', "'\\\"", ".\\}", "\\}")):
            continue
        text: Optional[str] = line
        if line.startswith((".", "'")):
            name, _, rest = line[1:].strip().partition(" ")
            args = _roff_args(rest)
            text = None
            if name in _ROFF_NOFILL:
                flush()
                nofill = _ROFF_NOFILL[name]
            elif name in _ROFF_HEADING:
                flush()
                out.extend(["", " ".join(args)])
            elif name in _ROFF_BREAK:
                flush()
                if name not in ("br", "RS", "RE"):
                    out.append("")
                if name in ("IP", "It") and args:
                    text = args[0] if name == "IP" else " ".join(args)
            elif name in _ROFF_JOINED:
                text = "".join(args)
            elif name in _ROFF_INLINE:
                text = " ".join(args)
        if text is None:
            continue
        text = _roff_escapes(text)
        if nofill:
            out.append(text)
        elif not text.strip():
            flush()
            out.append("")
        else:
            para.append(text.strip())
    flush()
    return "\n".join(out)


_POD_DROP = re.compile(r"[XZ]<[^<>]*>")
_POD_LINK = re.compile(r"L<([^<>|]*)\|?[^<>]*>")
_POD_INLINE = re.compile(r"[BICFES]<([^<>]*)>")
_POD_INLINE_DOUBLE = re.compile(r"[BICFLES]<<+\s(.*?)\s>>+")


def pod_text(raw: str) -> str:
    """Text of a POD page: headings and items kept, other commands dropped, formatting codes
    (``B<...>``, ``C<< ... >>``, ``L<text|link>``) replaced by their text, index entries
    (``X<...>``) dropped."""
    out: list[str] = []
    for line in raw.splitlines():
        if line.startswith("="):
            cmd, _, rest = line[1:].partition(" ")
            if cmd.startswith(("head", "item")):
                out.append(rest)
            continue
        out.append(line)
    text = "\n".join(out)
    text = _POD_INLINE_DOUBLE.sub(r"\1", text)
    for _ in range(3):  # nested codes, innermost first
        text = _POD_DROP.sub("", text)
        text = _POD_LINK.sub(r"\1", text)
        text = _POD_INLINE.sub(r"\1", text)
    return text


@dataclass(frozen=True)
class Source:
    """One Debian package and the files of it that become documents."""

    package: str
    what: str
    license: str
    globs: tuple[str, ...]  # relative to the extracted package root
    to_text: Callable[[str], str]
    exclude: tuple[str, ...] = ()  # regexes on the path relative to the root
    # Drop the lines found in more than this share of the package's documents (navigation
    # bars of HTML manuals); None keeps every line (headings like "SYNOPSIS" recur by design).
    boilerplate_share: Optional[float] = None

    def files(self, root: Path) -> list[Path]:
        # Symlinks (a man page under a second name) would only add duplicates.
        found = {p for g in self.globs for p in root.glob(g) if p.is_file() and not p.is_symlink()}
        drop = [re.compile(x) for x in self.exclude]
        return sorted(p for p in found if not any(d.search(str(p.relative_to(root))) for d in drop))


SOURCES: tuple[Source, ...] = (
    Source("linux-doc-6.1", "Linux kernel Documentation/ (reST, text)",
           "GPL-2 (some files GPL-2+, LGPL-2.1, GFDL-1.1+ or CC-BY-4.0, as their SPDX lines say)",
           ("usr/share/doc/linux-doc-6.1/Documentation/**/*.gz",), plain_text,
           exclude=(r"\.(yaml|svg|dot|sh|py|litmus|exceptions|json|pl|c|h|awk|tex)\.gz$",)),
    Source("python3.11-doc", "Python 3.11 documentation (reST sources)", "PSF-2.0",
           ("usr/share/doc/python3.11/html/_sources/**/*.txt",), plain_text),
    Source("perl-doc", "Perl 5 manual (POD)", "GPL-1+ or Artistic",
           ("usr/share/perl/*/pod/*.pod",), pod_text),
    Source("postgresql-doc-15", "PostgreSQL 15 manual (HTML)", "PostgreSQL",
           ("usr/share/doc/postgresql-doc-15/html/*.html",), html_text, boilerplate_share=0.9),
    Source("git-doc", "Git manual pages and guides (AsciiDoc)", "GPL-2",
           ("usr/share/doc/git-doc/**/*.txt",), plain_text),
    Source("manpages", "Linux man-pages, sections 1, 4-8 (roff)", "Linux-man-pages-copyleft, GPL-2+",
           ("usr/share/man/man*/*.gz",), roff_text),
    Source("manpages-dev", "Linux man-pages, sections 2-3 (roff)", "Linux-man-pages-copyleft, GPL-2+",
           ("usr/share/man/man*/*.gz",), roff_text),
    Source("debian-handbook", "The Debian Administrator's Handbook (HTML, en-US)",
           "GPL-2.0+ or CC-BY-SA-3.0",
           ("usr/share/doc/debian-handbook/html/en-US/*.html",), html_text, boilerplate_share=0.9),
    Source("debian-reference-en", "Debian Reference (HTML)", "GPL-2+",
           ("usr/share/doc/debian-reference-en/docs/*.en.html",), html_text),
)
SOURCE_NAMES = tuple(s.package for s in SOURCES)


# ------------------------------------------------------------------------------ packages
def _deb_for(package: str, debs: Path) -> Optional[Path]:
    found = sorted(debs.glob(f"{package}_*.deb"))
    return found[-1] if found else None


def fetch_debs(sources: Iterable[Source], debs: Path, download: bool) -> tuple[dict[str, Path], list[Path]]:
    """The .deb of every source in ``debs``, and those of them this call downloaded: missing
    ones come from ``apt-get download``."""
    debs.mkdir(parents=True, exist_ok=True)
    found: dict[str, Path] = {}
    downloaded: list[Path] = []
    for s in sources:
        deb = _deb_for(s.package, debs)
        if deb is None and download:
            if shutil.which("apt-get") is None:
                raise CorpusError(f"no {s.package}_*.deb in {debs} and no apt-get here; put the "
                                  f".deb files there (apt-get download {s.package}) and pass --debs")
            r = subprocess.run(["apt-get", "download", s.package], cwd=debs, capture_output=True,
                               text=True)
            deb = _deb_for(s.package, debs)
            if r.returncode or deb is None:
                why = (r.stderr or r.stdout).strip().splitlines()
                raise CorpusError(f"apt-get download {s.package} failed ({why[-1] if why else r.returncode});"
                                  f" run apt-get update first, or put the .deb into {debs}")
            downloaded.append(deb)
        if deb is None:
            raise CorpusError(f"no {s.package}_*.deb in {debs} (and --no-download); "
                              f"get it with: cd {debs} && apt-get download {s.package}")
        found[s.package] = deb
    return found, downloaded


def remove_downloads(downloaded: list[Path], debs: Path) -> None:
    """The .deb files this call downloaded, and ``debs`` itself when that leaves it empty; .deb
    files that were there before stay."""
    for deb in downloaded:
        deb.unlink(missing_ok=True)
    if debs.is_dir() and not any(debs.iterdir()):
        debs.rmdir()


def _deb_field(deb: Path, name: str) -> str:
    r = subprocess.run(["dpkg-deb", "-f", str(deb), name], capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def extract(deb: Path, dest: Path) -> Path:
    if shutil.which("dpkg-deb") is None:
        raise CorpusError("dpkg-deb is needed to unpack the .deb files (apt-get install dpkg)")
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["dpkg-deb", "-x", str(deb), str(dest)], check=True)
    return dest


# ------------------------------------------------------------------------------ documents
def normalize(text: str) -> str:
    """Trailing spaces off, control characters out, at most two blank lines in a row."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = re.sub(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]", "", text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = re.sub(r"\n{4,}", "\n\n\n", text)
    return text.strip("\n")


def content_hash(text: str) -> str:
    """SHA-256 of the text with all whitespace runs as one space: the identity for dedup
    and for the split."""
    return hashlib.sha256(" ".join(text.split()).encode("utf-8")).hexdigest()


def drop_boilerplate(texts: list[str], share: Optional[float]) -> list[str]:
    """Without the non-blank lines that appear in more than ``share`` of ``texts`` (only
    when there are enough documents to tell)."""
    if share is None or len(texts) < 8:
        return texts
    counts = Counter(line for t in texts for line in {x.strip() for x in t.split("\n")} if line)
    common = {line for line, n in counts.items() if n > share * len(texts)}
    if not common:
        return texts
    return ["\n".join(x for x in t.split("\n") if x.strip() not in common) for t in texts]


def documents(source: Source, root: Path) -> tuple[list[tuple[str, str]], int]:
    """(relative path, text) of the source's documents under ``root``, and how many files
    were read."""
    files = source.files(root)
    texts = [normalize(source.to_text(_read(p))) for p in files]
    texts = [normalize(t) for t in drop_boilerplate(texts, source.boilerplate_share)]
    docs = [(str(p.relative_to(root)), t) for p, t in zip(files, texts) if len(t) >= MIN_CHARS]
    return docs, len(files)


def in_validation(digest: str, permyriad: int) -> bool:
    return int(digest[:8], 16) % 10_000 < permyriad


def pieces(text: str, limit: int = MAX_PIECE_CHARS) -> list[str]:
    """``text`` cut at blank lines into pieces of at most ``limit`` characters (a paragraph
    longer than that is cut at line ends, then hard)."""
    if len(text) <= limit:
        return [text]
    out: list[str] = []
    current = ""
    for para in re.split(r"(\n\n+)", text):
        while len(para) > limit:
            cut = para.rfind("\n", 0, limit)
            cut = cut if cut > 0 else limit
            if current:
                out.append(current)
                current = ""
            out.append(para[:cut])
            para = para[cut:]
        if len(current) + len(para) > limit:
            out.append(current)
            current = ""
        current += para
    if current.strip():
        out.append(current)
    return [p.strip("\n") for p in out if p.strip()]


def _write_jsonl_gz(rows: list[dict], path: Path) -> None:
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0, compresslevel=9) as f:
        for row in rows:
            f.write((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8"))
    path.write_bytes(buf.getvalue())


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _train_tokenizer() -> Callable[..., None]:
    """``train_tokenizer`` of scripts/build_tiny_assets.py: one way to build a tokenizer."""
    spec = importlib.util.spec_from_file_location("build_tiny_assets", Path(__file__).with_name("build_tiny_assets.py"))
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.train_tokenizer


# ------------------------------------------------------------------------------ build
def build(out: Path, roots: dict[str, Path], versions: dict[str, str], *,
          vocab_size: int = VOCAB_SIZE, val_permyriad: int = VAL_PERMYRIAD,
          log: Callable[[str], None] = print) -> dict:
    """Write the corpus from already unpacked packages (``roots``: package -> its root)."""
    by_name = {s.package: s for s in SOURCES}
    seen: set[str] = set()
    split: dict[str, list[dict]] = {"train": [], "validation": []}
    split_docs = {"train": 0, "validation": 0}
    per_package = []
    for package, root in roots.items():
        source = by_name[package]
        docs, nfiles = documents(source, root)
        kept = dups = chars = 0
        for path, text in docs:
            digest = content_hash(text)
            if digest in seen:
                dups += 1
                continue
            seen.add(digest)
            kept += 1
            chars += len(text)
            name = "validation" if in_validation(digest, val_permyriad) else "train"
            split_docs[name] += 1
            for i, piece in enumerate(pieces(text)):
                split[name].append({"text": piece, "source": package,
                                    "_order": content_hash(f"{digest}:{i}")})
        licence_file = root / "usr/share/doc" / package / "copyright"
        if licence_file.is_file():
            (out / CORPUS_FILES.licenses).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(licence_file, out / CORPUS_FILES.licenses / package)
        per_package.append({"package": package, "version": versions.get(package, "unknown"),
                            "what": source.what, "license": source.license,
                            "copyright": f"{CORPUS_FILES.licenses}/{package}" if licence_file.is_file() else None,
                            "files": nfiles, "documents": kept, "duplicates_dropped": dups,
                            "characters": chars})
        log(f"  {package}: {nfiles} files -> {kept} documents ({chars / 1e6:.1f} M chars, "
            f"{dups} duplicates dropped)")
    if not split["train"] or not split["validation"]:
        raise CorpusError(f"too few documents for a train/validation split "
                          f"({len(split['train'])} / {len(split['validation'])}); add sources "
                          f"or raise --val-permyriad")

    out.mkdir(parents=True, exist_ok=True)
    files = {"train": out / CORPUS_FILES.train, "validation": out / CORPUS_FILES.validation}
    for name, rows in split.items():
        rows.sort(key=lambda r: r.pop("_order"))
        _write_jsonl_gz(rows, files[name])

    log(f"  training a {vocab_size}-id byte-level BPE tokenizer on the train split ...")
    train_texts = [r["text"] for r in split["train"]]
    _train_tokenizer()(train_texts, out / CORPUS_FILES.tokenizer, vocab_size)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / CORPUS_FILES.tokenizer / "tokenizer.json"))
    splits = {}
    for name, rows in split.items():
        texts = [r["text"] for r in rows]
        tokens = sum(len(e.ids) for e in tok.encode_batch(texts))
        chars = sum(len(t) for t in texts)
        splits[name] = {"file": files[name].name, "documents": split_docs[name],
                        "pieces": len(rows), "characters": chars,
                        "utf8_bytes": sum(len(t.encode()) for t in texts),
                        "tokens": tokens, "chars_per_token": round(chars / max(1, tokens), 3)}
    outputs = {p.relative_to(out).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
               for p in sorted(out.rglob("*")) if p.is_file() and p.name != CORPUS_FILES.manifest}
    manifest = {
        "dataset": CORPUS_DATASET,
        "sha256": corpus_sha256(outputs),
        "built_by": "scripts/build_corpus.py",
        "split_rule": f"validation iff int(sha256(whitespace-normalised text)[:8], 16) % 10000 < {val_permyriad}",
        "max_piece_chars": MAX_PIECE_CHARS,
        "tokenizer": {"kind": "byte-level BPE (tokenizers)", "trained_on": "train",
                      "vocab_size": tok.get_vocab_size(), "requested_vocab_size": vocab_size},
        "splits": splits,
        "packages": per_package,
        "files": outputs,
        "total_bytes": sum(f["bytes"] for f in outputs.values()),
    }
    (out / CORPUS_FILES.manifest).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default data/corpus)")
    ap.add_argument("--debs", type=Path, default=DEFAULT_DEBS,
                    help="folder with the .deb files (default data/debs); missing ones are "
                         "fetched with apt-get download unless --no-download")
    ap.add_argument("--no-download", action="store_true", help="use only the .deb files in --debs")
    ap.add_argument("--keep-debs", action="store_true",
                    help="keep the .deb files this call downloads (default: removed once the corpus is built)")
    ap.add_argument("--only", default=",".join(SOURCE_NAMES),
                    help=f"comma-separated packages (default all: {','.join(SOURCE_NAMES)})")
    ap.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    ap.add_argument("--val-permyriad", type=int, default=VAL_PERMYRIAD,
                    help="validation share in 1/10,000 (default 200 = 2%%)")
    args = ap.parse_args(argv)

    wanted = [p for p in args.only.split(",") if p]
    unknown = sorted(set(wanted) - set(SOURCE_NAMES))
    if unknown:
        print(f"build_corpus: unknown package(s) {unknown}; known: {list(SOURCE_NAMES)}", file=sys.stderr)
        return 2
    if not 0 < args.val_permyriad < 10_000:
        print("build_corpus: --val-permyriad must be between 1 and 9999", file=sys.stderr)
        return 2
    if not 256 < args.vocab_size <= 65536:
        print("build_corpus: --vocab-size must be in 257..65536 (byte alphabet + merges; "
              "token ids fit uint16)", file=sys.stderr)
        return 2
    sources = [s for s in SOURCES if s.package in wanted]
    debs_dir = args.debs
    try:
        debs, downloaded = fetch_debs(sources, debs_dir, download=not args.no_download)
        with tempfile.TemporaryDirectory(prefix="corpus-") as tmp:
            roots = {p: extract(deb, Path(tmp) / p) for p, deb in debs.items()}
            versions = {p: _deb_field(deb, "Version") for p, deb in debs.items()}
            print(f"building {args.out} from {len(roots)} packages:")
            manifest = build(args.out, roots, versions, vocab_size=args.vocab_size,
                             val_permyriad=args.val_permyriad)
    except CorpusError as e:
        print(f"build_corpus: {e}", file=sys.stderr)
        return 2
    if downloaded and not args.keep_debs:
        remove_downloads(downloaded, debs_dir)
        print(f"removed the {len(downloaded)} downloaded .deb files (--keep-debs keeps them in {debs_dir})")
    for name, s in manifest["splits"].items():
        print(f"  {name}: {s['pieces']} pieces, {s['characters'] / 1e6:.1f} M chars, "
              f"{s['tokens'] / 1e6:.2f} M tokens")
    print(f"corpus sha256 {manifest['sha256']}")
    print(f"wrote {args.out} ({manifest['total_bytes'] / 2**20:.1f} MiB: "
          + ", ".join(f"{k} {v['bytes'] / 2**20:.1f} MiB" for k, v in manifest["files"].items()
                      if v["bytes"] > 2**18) + ")")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
