"""Data-set tasks: prompts and reference answers from a user's JSONL or Parquet file (GSM8K, MATH, their own).

    env: {adapter: text, id: dataset,
          options: {path: gsm8k_train.jsonl, prompt_field: question, answer_field: answer, reward: gsm8k}}

A row's prompt is a string or a list of chat messages. With ``template`` ("Question: {prompt}\\nAnswer:") it
becomes plain text; otherwise it becomes chat messages (``system_prompt`` first, if given) and crosses the data
plane as a chat (services/core/textdata.py), which the rollout renders with the checkpoint's chat template. The
row's other fields go to the reward as ``**fields``.

Held-out rows: ``eval_path`` names a file of its own; without one, a row is held out when a hash of its prompt
falls in ``held_out_fraction`` (as arithmetic splits), so train and held-out never share a prompt. ``split``
picks which one a task draws from.

Search-R1 style retrieval: ``tools: [search]`` with ``corpus: passages.jsonl`` (a "text" field, an optional
"title") answers a ``<search>query</search>`` turn with the best BM25 passage; ``<answer>...</answer>`` ends the
episode (the protocol of services/env/tasks/tools.py). The index is built once per env process.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlfabric.services.core.paths import DataRoots
from rlfabric.services.core.textdata import DataFileError, chat_text, is_messages, read_rows, render_prompt
from rlfabric.services.env.tasks.arith import held_out
from rlfabric.services.env.tasks.tools import ToolError

TOOLS = ("search",)
SEARCH_PROMPT = ("Answer the question. To look something up, write <search>query</search> and read the <result> "
                 "that comes back. Give your final answer as <answer>...</answer>.")
MAX_QUERY_CHARS = 512
MAX_PASSAGE_CHARS = 2000  # what one search hands back: a passage, not a document
_CACHE_FILES = 8

_lock = threading.Lock()
_roots: DataRoots | None = None
_files: dict[tuple, list[dict[str, Any]]] = {}
_corpora: dict[tuple, Corpus] = {}


def set_data_roots(roots: DataRoots | None) -> None:
    """Where a run spec's data files may be read in this process (the env service's ``--data-root``)."""
    global _roots
    _roots = roots


def data_roots() -> DataRoots:
    """The roots set by the service, else RLFABRIC_DATA_ROOT, else anywhere (a user's own process)."""
    if _roots is not None:
        return _roots
    env = os.environ.get("RLFABRIC_DATA_ROOT", "").strip()
    return DataRoots.parse(env) if env else DataRoots.anywhere()


def _read(path: str, option: str) -> tuple[tuple | None, list[dict[str, Any]]]:
    """The rows of a data file, read once per process while the file stays the same (path, size, mtime), and
    that identity (None when the file could not be looked at before reading)."""
    roots = data_roots()
    try:
        resolved = roots.confine(path, option)
        st = resolved.stat()
        key = (str(resolved), st.st_mtime_ns, st.st_size)
    except (OSError, ValueError):
        key = None  # read_rows names what is wrong
    with _lock:
        if key in _files:
            return key, _files[key]
    rows = read_rows(path, option, roots)
    if key is not None:
        with _lock:
            while len(_files) >= _CACHE_FILES:
                _files.pop(next(iter(_files)))
            _files[key] = rows
    return key, rows


@dataclass(frozen=True)
class Row:
    """One problem of a data set: its prompt as it crosses the data plane, its reference answer, its other fields."""

    index: int  # the row's number in its file, from 0
    prompt: str
    answer: str
    fields: dict[str, Any] = field(compare=False, hash=False)
    source: str = "path"  # the option that named its file: path or eval_path

    @property
    def id(self) -> str:
        """What a log line names the problem by."""
        return f"{self.source} row {self.index}"


class Corpus:
    """A BM25 index (bm25s) over passages; a search hands back the best one."""

    def __init__(self, rows: list[dict[str, Any]], option: str = "env.options.corpus"):
        import bm25s

        self.passages: list[str] = []
        for i, row in enumerate(rows):
            text, title = row.get("text"), row.get("title")
            if not isinstance(text, str) or not text.strip():
                raise DataFileError(f"{option} row {i} has no 'text' string (its fields: {sorted(row)[:10]}). Fix: "
                                    f"one passage per row, in a 'text' field (and an optional 'title')")
            if title is not None and not isinstance(title, str):
                raise DataFileError(f"{option} row {i}: 'title' is a {type(title).__name__}; a title is a string")
            self.passages.append(f"{title}\n{text}" if title else text)
        self.index = bm25s.BM25()
        self.index.index(bm25s.tokenize(self.passages, stopwords="en", show_progress=False), show_progress=False)

    def search(self, query: str) -> str:
        import bm25s

        tokens = bm25s.tokenize([query[:MAX_QUERY_CHARS]], stopwords="en", return_ids=False, show_progress=False)
        if not tokens[0]:
            raise ToolError("the query has no words to search for")
        docs, scores = self.index.retrieve(tokens, k=1, show_progress=False, n_threads=0)
        if not scores[0][0] > 0:
            raise ToolError(f"no passage matches {query[:40]!r}")
        return self.passages[int(docs[0][0])][:MAX_PASSAGE_CHARS]


def corpus(path: str, option: str = "env.options.corpus") -> Corpus:
    """The corpus of a file, indexed once per env process (the same file gives the same index)."""
    key, rows = _read(path, option)
    with _lock:
        found = _corpora.get(key) if key is not None else None
    if found is None:
        found = Corpus(rows, option)
        with _lock:
            _corpora.clear()  # one corpus per run: keep the last, not every one a long-lived service has seen
            if key is not None:
                _corpora[key] = found
    return found


def _text(value: Any, row: int, name: str, option: str, path: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    raise DataFileError(f"env.options.{option}={path!r} row {row}: the answer field {name!r} holds a "
                        f"{type(value).__name__}; a reference answer is a string or a number")


class DatasetTask:
    """Rows of a data file as text problems. ``problem``, ``prompt``, ``transcript`` and ``problems`` are the
    interface the text adapter and supervised warm starts use, as for the generated tasks."""

    def __init__(self, path: str, split: str = "train", held_out_fraction: float = 0.2, prompt_field: str = "prompt",
                 answer_field: str = "answer", system_prompt: str | None = None, template: str | None = None,
                 eval_path: str | None = None, tools: list[str] | tuple[str, ...] = (), corpus: str | None = None):
        if split not in ("train", "held_out"):
            raise ValueError(f"env.options.split={split!r}: use train or held_out")
        if not 0 < held_out_fraction < 1:
            raise ValueError(f"env.options.held_out_fraction={held_out_fraction!r}: a share in (0, 1)")
        unknown = [t for t in tools if t not in TOOLS]
        if unknown:
            raise ValueError(f"env.options.tools={list(tools)!r}: a data-set task offers {list(TOOLS)}")
        if "search" in tools and not corpus:
            raise ValueError("env.options.tools names search but env.options.corpus is not set. Fix: corpus: a "
                             "JSONL file of passages (a 'text' field, an optional 'title')")
        if corpus and "search" not in tools:
            raise ValueError("env.options.corpus is set but env.options.tools does not name search. Fix: "
                             "tools: [search], or drop corpus")
        self.split, self.fraction = split, held_out_fraction
        self.prompt_field, self.answer_field = prompt_field, answer_field
        self.system_prompt, self.template = system_prompt, template
        if template is not None:
            render_prompt("probe", template=template)
        self.tools = {"search": _Search(corpus)} if "search" in tools else {}
        self.multi_turn = bool(self.tools)
        if self.multi_turn and system_prompt is None and template is None:
            self.system_prompt = SEARCH_PROMPT
        if eval_path:
            option, chosen = ("path", path) if split == "train" else ("eval_path", eval_path)
            self.rows = self._rows(chosen, option, lambda _raw: True)
        else:
            want = split == "held_out"
            self.rows = self._rows(path, "path", lambda raw: held_out(raw, held_out_fraction) == want)
            if not self.rows:
                raise ValueError(f"env.options.path={path!r}: no row falls in the {split} split at "
                                 f"held_out_fraction={held_out_fraction}. Fix: more rows, another held_out_fraction, "
                                 f"or a held-out file of its own in env.options.eval_path")
        if "search" in tools:
            self.tools["search"].load()

    def _rows(self, path: str, option: str, keep) -> list[Row]:
        out = []
        for i, row in enumerate(_read(path, f"env.options.{option}")[1]):
            for name, what in ((self.prompt_field, "prompt"), (self.answer_field, "answer")):
                if row.get(name) is None:
                    raise DataFileError(
                        f"env.options.{option}={path!r} row {i} has no {name!r} field (its fields: "
                        f"{sorted(row)[:20]}). Fix: set env.options.{what}_field to the field that holds the {what}")
            value = row[self.prompt_field]
            if not (isinstance(value, str) or is_messages(value)):
                raise DataFileError(f"env.options.{option}={path!r} row {i}: the prompt field {self.prompt_field!r} "
                                    f"holds a {type(value).__name__}; a prompt is a string or a list of "
                                    f"{{'role': str, 'content': str}} messages")
            if not keep(value if isinstance(value, str) else chat_text(value)):
                continue
            prompt = render_prompt(value, self.system_prompt, self.template)
            answer = _text(row[self.answer_field], i, self.answer_field, option, path)
            fields = {k: v for k, v in row.items() if k not in (self.prompt_field, self.answer_field)}
            out.append(Row(i, prompt, answer, fields, option))
        return out

    def problem(self, rng: np.random.Generator) -> Row:
        return self.rows[int(rng.integers(len(self.rows)))]

    def prompt(self, problem: Row) -> str:
        return problem.prompt

    def transcript(self, problem: Row) -> list[tuple[str, bool]]:
        """A correct episode as (text, said by the model) segments: the reference answer (in an <answer> tag for
        a task with tools)."""
        said = f"<answer>{problem.answer}</answer>" if self.multi_turn else problem.answer
        return [(self.prompt(problem), False), (said, True)]

    def problems(self, n: int, seed: int) -> list[Row]:
        rng = np.random.default_rng(seed)
        return [self.problem(rng) for _ in range(n)]


class _Search:
    """The search tool over a corpus file, indexed when the task is built (not on the first call)."""

    def __init__(self, path: str):
        self.path = path
        self.corpus: Corpus | None = None

    def load(self) -> None:
        self.corpus = corpus(self.path)

    def __call__(self, query: str) -> str:
        if self.corpus is None:
            self.load()
        return self.corpus.search(query)


__all__ = ["Corpus", "DatasetTask", "Row", "corpus", "data_roots", "set_data_roots"]
