"""The repository documents the product, not its making: no tracked text narrates how or when it was
developed (numbered rounds of work, machines that were or were not available, budgets of device
time, who ran what, before/after-this-change timelines), and no tracked path is named after a round
of work. Legitimate uses of the same words stay allowed: pytest's session scope, a wandb or SLURM
session, ``start_new_session``, ``requests.Session``, a stop signal, a requeue budget."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ORDINAL = (r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
           r"thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|"
           r"\d+(?:st|nd|rd|th))")
# (name, pattern): each names one way a text narrates its own development.
NARRATION = [
    ("numbered round of work", rf"(?<![a-z]){ORDINAL}[ _-](?:work[ _-])?(?:session|sprint)s?\b"),
    ("round of work", r"\b(?:this|that|previous|next|last|earlier|later|same) (?:session's|sprint)"),
    ("numbered stop", r"\bstops? \d+\b|\b(?:this|that|previous|next|last|earlier) stop\b(?! signal)"),
    ("machine availability", r"\b(?:was|were|been|is|are|be|got|get) (?:not )?lent\b|\bmachines? lent\b"),
    ("machine availability", r"\b(?:no|until an?|when an?) \d+-GPU machine\b"),
    ("device budget", r"\b(?:device|gpu|minute|hour)[- ](?:budget|lease)\b|\bdevice (?:call|time) "
                      r"(?:was|being|ran|left|of)\b|\bbudget (?:ran out|was spent)\b"),
    ("who ran what", r"\bthe lead(?:'s)? (?:ran|runs|measured|merged|machine)\b|\bdevelopers' guide measured\b"),
    ("timeline", r"\bbefore (?:that|this) change\b|\bsince (?:that|this) change\b|\b(?:as of|until) (?:this|that) "
                 r"(?:commit|session)\b"),
]
PATTERNS = [(name, re.compile(p, re.IGNORECASE)) for name, p in NARRATION]
ROUND_PATH = re.compile(rf"{ORDINAL}_(?:session|stop|round)", re.IGNORECASE)
SKIP = {Path(__file__).resolve()}  # the word list itself


def tracked_files() -> list[Path]:
    try:
        proc = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True)
    except OSError:  # no git command
        proc = None
    if proc is not None and proc.returncode == 0:
        return [REPO / p for p in proc.stdout.decode().split("\0") if p]
    skip = {".git", ".venv-titan030", "__pycache__", "outputs", "multirun"}  # no git: every file here
    return [p for p in REPO.rglob("*") if p.is_file() and not skip & set(p.relative_to(REPO).parts)]


def text_of(path: Path) -> str | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if b"\0" in data[:8192]:
        return None  # binary
    return data.decode("utf-8", errors="replace")


def narration_hits(files: list[Path]) -> list[str]:
    hits = []
    for path in files:
        rel = path.relative_to(REPO)
        if ROUND_PATH.search(str(rel)):
            hits.append(f"{rel}: path named after a round of work")
        if path.resolve() in SKIP:
            continue
        text = text_of(path)
        if text is None:
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            for name, pattern in PATTERNS:
                if pattern.search(line):
                    hits.append(f"{rel}:{lineno}: [{name}] {line.strip()[:160]}")
                    break
    return hits


def test_no_tracked_text_narrates_development():
    hits = narration_hits(tracked_files())
    assert not hits, f"{len(hits)} lines narrate how the project was developed:\n" + "\n".join(hits)


def test_the_word_list_catches_narration_and_spares_ordinary_uses(tmp_path):
    caught = [
        "measured in the tenth session on one H200", "RESULTS.md, 7th session", "h200x2_fifth_session/",
        "this session's code", "the previous stop's runs", "(stop 6)", "only one-GPU machines were lent",
        "when a 2-GPU machine is lent", "no 8-GPU machine has run it", "the device budget ran out",
        "the device time being spent", "the lead's runs that have no raw JSON",
        "the training numbers above are from before that change",
    ]
    spared = [
        '@pytest.fixture(scope="session")', "subprocess.Popen(cmd, start_new_session=True)",
        "a wandb session", "requests.Session()", "the first stop signal this process gets",
        "requeue budget", "Register this session: a session that started the cluster stops it",
        "kernels by device time", "on a GPU machine", "a one-GPU machine cannot hold two ranks",
        "MXFP8's lead over bf16", "the second round of timing", "step 7/20",
    ]
    for line in caught:
        assert any(p.search(line) for _, p in PATTERNS), line
    for line in spared:
        assert not any(p.search(line) for _, p in PATTERNS), line
    assert ROUND_PATH.search("benchmarks/results/h200_one_gpu_tenth_session/x.json")
