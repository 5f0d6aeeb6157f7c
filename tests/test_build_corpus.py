"""scripts/build_corpus.py on fake Debian packages built here with dpkg-deb (nothing is
downloaded): extraction, boilerplate and duplicate removal, the hash split, byte-identical
rebuilds, the tokenizer torchtitan loads, the manifest, and the errors before anything runs."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.corpus_files import sample_texts
from tests.hydra_compose import REPO

spec = importlib.util.spec_from_file_location("build_corpus", REPO / "scripts" / "build_corpus.py")
build_corpus = importlib.util.module_from_spec(spec)
sys.modules["build_corpus"] = build_corpus  # dataclasses look their module up there
spec.loader.exec_module(build_corpus)

BIG = "\n\n".join(f"Paragraph {i}. " + " ".join(sample_texts(1, words=60, offset=i)) for i in range(300))


def make_deb(debs: Path, package: str, files: dict[str, str | bytes], symlinks: dict[str, str] = {}) -> None:
    root = debs / f"stage-{package}"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text(
        f"Package: {package}\nVersion: 1.0-test\nArchitecture: all\nMaintainer: t <t@example.org>\n"
        f"Description: fake {package}\n")
    for rel, data in {**files, f"usr/share/doc/{package}/copyright": f"License: test-{package}\n"}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
    for rel, target in symlinks.items():
        os.symlink(target, root / rel)
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "--build", str(root),
                    str(debs / f"{package}_1.0-test_all.deb")], check=True, capture_output=True)


def roff(title: str, body: str) -> bytes:
    page = (f'.\\" a comment\n.TH {title.upper()} 7\n.SH NAME\n{title} \\- {body[:30]}\n'
            f".SH DESCRIPTION\nThe\n.B {title}\nfacility \\fBdoes\\fP this:\n{body}\n.PP\n.BR open (2)\n")
    return gzip.compress(page.encode(), mtime=0)


def html(title: str, body: str) -> str:
    return (f"<html><head><title>{title}</title><style>p {{}}</style></head><body>"
            f'<div class="navheader"><a href="x.html">Prev</a> Up Home</div>'
            f"<h1>{title}</h1><p>{body}</p><pre>SELECT {title[-1]};\n  FROM t{title[-1]};</pre>"
            f"<p>Submit correction: found a mistake in this page</p></body></html>")


def test_boilerplate_only_where_asked():
    texts = [f"NAME\nnav bar\nbody {i}" for i in range(10)]
    assert build_corpus.drop_boilerplate(texts, None) == texts
    assert build_corpus.drop_boilerplate(texts, 0.9) == [f"body {i}" for i in range(10)]


@pytest.fixture(scope="module")
def debs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("debs")
    texts = sample_texts(40, words=80)
    rst = {f"usr/share/doc/python3.11/html/_sources/lib/m{i}.rst.txt": f"Title {i}\n=====\n\n{t}\n"
           for i, t in enumerate(texts[:30])}
    # the same text with other whitespace (a duplicate), a stub, one document over 64 KiB
    rst["usr/share/doc/python3.11/html/_sources/lib/dup.rst.txt"] = "Title   0\n=====\n\n" + texts[0] + "  \n\n"
    rst["usr/share/doc/python3.11/html/_sources/stub.rst.txt"] = "tiny"
    rst["usr/share/doc/python3.11/html/_sources/big.rst.txt"] = BIG
    make_deb(d, "python3.11-doc", rst)
    make_deb(d, "manpages", {"usr/share/man/man7/a.7.gz": roff("alpha", texts[30]),
                             "usr/share/man/man7/b.7.gz": roff("beta", texts[31]),
                             "usr/share/man/man7/c.7.gz": gzip.compress(b".so man7/a.7\n", mtime=0)},
             symlinks={"usr/share/man/man7/d.7.gz": "a.7.gz"})
    make_deb(d, "postgresql-doc-15", {f"usr/share/doc/postgresql-doc-15/html/p{i}.html": html(f"Page {i}", t)
                                      for i, t in enumerate(texts[32:40])})
    return d


ONLY = "python3.11-doc,manpages,postgresql-doc-15"


def build(debs: Path, out: Path, *extra: str) -> int:
    return build_corpus.main(["--debs", str(debs), "--no-download", "--only", ONLY, "--out", str(out),
                              "--vocab-size", "300", "--val-permyriad", "3000", *extra])


def rows(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def corpus(debs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corpus") / "c"
    assert build(debs, out) == 0
    return out


def test_documents_split_and_manifest(corpus):
    train, val = rows(corpus / "train.jsonl.gz"), rows(corpus / "validation.jsonl.gz")
    texts = [r["text"] for r in train + val]
    manifest = json.loads((corpus / "manifest.json").read_text())
    packages = {p["package"]: p for p in manifest["packages"]}
    assert set(packages) == set(ONLY.split(",")) and all(p["version"] == "1.0-test" for p in packages.values())
    # 30 texts + the big one; the stub dropped and the whitespace variant deduplicated
    py = packages["python3.11-doc"]
    assert (py["files"], py["documents"], py["duplicates_dropped"]) == (33, 31, 1)
    # the .so page has no text of its own and the symlink is not read
    assert (packages["manpages"]["files"], packages["manpages"]["documents"]) == (3, 2)
    assert manifest["splits"]["train"]["documents"] + manifest["splits"]["validation"]["documents"] == 41
    assert not any(t.strip() == "tiny" for t in texts)
    # every document went where its hash says; the big one's pieces all went together
    big_pieces = [r for r in train + val if r["text"].startswith("Paragraph") or "\n\nParagraph" in r["text"]]
    assert len(big_pieces) > 1 and all(len(r["text"]) <= build_corpus.MAX_PIECE_CHARS for r in big_pieces)
    assert "\n\n".join(sorted((r["text"] for r in big_pieces), key=lambda t: int(t.split(".")[0].split()[-1]))) == BIG
    in_val = build_corpus.in_validation(build_corpus.content_hash(BIG), 3000)
    assert {r["text"] in [v["text"] for v in val] for r in big_pieces} == {in_val}
    for r in train + val:
        if r not in big_pieces:
            expected = build_corpus.in_validation(build_corpus.content_hash(r["text"]), 3000)
            assert (r in val) == expected
    assert len(val) > 0 and len(train) > len(val)
    assert (corpus / "licenses" / "manpages").read_text() == "License: test-manpages\n"
    assert manifest["files"]["train.jsonl.gz"]["bytes"] == (corpus / "train.jsonl.gz").stat().st_size


def test_markup_and_boilerplate_removed(corpus):
    texts = [r["text"] for r in rows(corpus / "train.jsonl.gz") + rows(corpus / "validation.jsonl.gz")]
    man = [t for t in texts if "facility" in t]
    assert len(man) == 2
    assert "The alpha facility does this:" in "\n".join(man)
    assert not any(x in t for t in man for x in (".SH", "\\f", ".B ", ".PP", 'a comment'))
    assert any("open(2)" in t for t in man)
    pages = [t for t in texts if t.startswith("Page ")]
    assert len(pages) == 8
    for t in pages:
        assert "Prev" not in t and "Submit correction" not in t and "p {}" not in t
        assert f"SELECT {t[5]};\n  FROM t{t[5]};" in t  # <pre> keeps its lines


def test_rebuild_is_byte_identical_and_tokenizer_loads(corpus, debs, tmp_path):
    again = tmp_path / "again"
    assert build(debs, again) == 0
    for name in ("train.jsonl.gz", "validation.jsonl.gz", "tokenizer/tokenizer.json"):
        assert (again / name).read_bytes() == (corpus / name).read_bytes(), name
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from launch.titan.data import tokenizer_vocab_size

    tok = HuggingFaceTokenizer(str(corpus / "tokenizer"))
    ids = tok.encode("the scheduler picks the next task", add_bos=True, add_eos=True)
    assert tok.decode(ids[1:-1]) == "the scheduler picks the next task"
    assert max(ids) < tokenizer_vocab_size(corpus / "tokenizer") <= 300
    manifest = json.loads((corpus / "manifest.json").read_text())
    assert manifest["tokenizer"]["vocab_size"] == tokenizer_vocab_size(corpus / "tokenizer")


def test_the_corpus_sha256_and_package_versions_are_what_results_record(corpus, debs, tmp_path):
    """The manifest's sha256 digests every file's name and SHA-256: a rebuild gives the same
    one, a changed file another; the parity rows read it and the package versions back."""
    import shutil

    from launch.titan.data import corpus_provenance, corpus_sha256

    manifest = json.loads((corpus / "manifest.json").read_text())
    assert manifest["sha256"] == corpus_sha256(manifest["files"]) and len(manifest["sha256"]) == 64
    assert set(manifest["files"]) >= {"train.jsonl.gz", "validation.jsonl.gz", "tokenizer/tokenizer.json"}
    assert corpus_provenance(corpus) == {"corpus_sha256": manifest["sha256"],
                                         "corpus_packages": {p: "1.0-test" for p in ONLY.split(",")}}
    edited = tmp_path / "edited"
    shutil.copytree(corpus, edited)
    (edited / "validation.jsonl.gz").write_bytes(b"other")
    files = {**manifest["files"],
             "validation.jsonl.gz": {"sha256": build_corpus._sha256(edited / "validation.jsonl.gz")}}
    assert corpus_sha256(files) != manifest["sha256"]
    assert corpus_provenance(tmp_path / "none") == {"corpus_sha256": None, "corpus_packages": None}


def test_downloaded_debs_are_removed_unless_kept(debs, tmp_path, monkeypatch, capsys):
    """apt-get (faked: it copies the package's fake .deb into the folder) fetches what --debs
    lacks; once the corpus is built those files go, the ones that were there stay; --keep-debs
    keeps both."""
    import shutil

    def fake_apt(cmd, cwd=None, **kw):
        if cmd[:2] == ["apt-get", "download"]:
            shutil.copy(debs / f"{cmd[2]}_1.0-test_all.deb", cwd)
            return subprocess.CompletedProcess(cmd, 0, "", "")
        return real_run(cmd, cwd=cwd, **kw)

    real_run = subprocess.run
    monkeypatch.setattr(build_corpus.subprocess, "run", fake_apt)
    monkeypatch.setattr(build_corpus.shutil, "which", lambda name: f"/usr/bin/{name}")
    for keep in (False, True):
        folder = tmp_path / f"debs{keep}"
        folder.mkdir()
        shutil.copy(debs / "manpages_1.0-test_all.deb", folder)  # the user's own
        extra = ("--keep-debs",) if keep else ()
        assert build_corpus.main(["--debs", str(folder), "--only", ONLY, "--out", str(tmp_path / f"c{keep}"),
                                  "--vocab-size", "300", "--val-permyriad", "3000", *extra]) == 0
        left = sorted(p.name for p in folder.iterdir())
        want = ["manpages_1.0-test_all.deb"] + (["postgresql-doc-15_1.0-test_all.deb",
                                                  "python3.11-doc_1.0-test_all.deb"] if keep else [])
        assert left == want, keep
        assert ("removed the 2 downloaded .deb files" in capsys.readouterr().out) is not keep


def test_errors_before_anything_is_built(debs, tmp_path, capsys):
    out = tmp_path / "out"
    assert build_corpus.main(["--debs", str(debs), "--no-download", "--only", "python3.11-doc,perl-doc",
                              "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no perl-doc_*.deb" in err and "apt-get download perl-doc" in err
    assert build_corpus.main(["--only", "nosuch-doc", "--out", str(out)]) == 2
    assert "unknown package(s) ['nosuch-doc']" in capsys.readouterr().err
    assert build_corpus.main(["--vocab-size", "100000", "--out", str(out)]) == 2
    assert not out.exists()


def test_pieces_cut_at_paragraphs():
    text = "\n\n".join("x" * 30 for _ in range(10))
    parts = build_corpus.pieces(text, limit=100)
    assert all(len(p) <= 100 for p in parts) and "\n\n".join(parts) == text
    assert build_corpus.pieces("a" * 250, limit=100) == ["a" * 100, "a" * 100, "a" * 50]


def test_pod_text():
    pod = "=head1 NAME\n\nperlfoo - B<bold> and C<< $x->y >> X<index> see L<perlsyn|perlsyn/x>\n\n=cut\n"
    assert build_corpus.pod_text(pod).split("\n") == ["NAME", "", "perlfoo - bold and $x->y  see perlsyn", ""]
