"""``qsfa golden generate --workers N | --scheduler ADDRESS``: golden cases computed on a Dask cluster.

Tasks are cases. A case runs in a worker's temporary directory exactly as a serial run writes it
(:func:`qsfa.golden.manifest._write_case`); the task returns the manifest entry and the bytes of its files,
and the client writes them under ``--out``. Long attention cases (QSFA / SFA / V4 shared-KV with more query rows
than one task should hold) are split: the case task returns the generated inputs instead, one task per range of query
rows computes those rows (:func:`qsfa.reference.attention.only_rows`; a row's bytes do not depend on the rows
computed with it), and the client assembles the outputs and writes the case (into the staging folder of
:func:`qsfa.golden.manifest.generate`, as a serial run does). The directory is byte-identical
to a serial run's (same manifest, same files) - tests/test_distributed.py compares them.

A case the operator cannot run fails the same way on every worker: its task returns the error instead of
raising it, so it is reported once (not once per Dask retry), the run stops as a serial run does (the previous
set in ``--out`` left as it was: the files are written into generate's staging folder, swapped in only when
every case is written), and the case is saved as ``<out>.failed/<case>.json`` to replay with
``qsfa golden generate --case``.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np

from ._cluster import ClusterUsageError, Tasks

__all__ = ["GoldenExecutor", "ROW_SPLIT_OPS", "ROW_TASK_WORK", "attention_rows"]

#: operators whose outputs are per query row (``qsfa.reference.attention.only_rows``)
ROW_SPLIT_OPS = ("kv_quant_sparse_flash_attention", "sparse_flash_attention",
                 # DeepSeek-V4 shared-KV attention (qsfa.reference.sharedkv honours only_rows too)
                 "sparse_flash_mla", "sparse_attn_sharedkv", "mixed_quant_sparse_flash_mla",
                 "kv_quant_sparse_attn_sharedkv", "quant_sparse_flash_mla")

#: default work of one row task, in query row x head x selected-token units: seconds of the reference on one
#: core (of the order of a million units per second here)
ROW_TASK_WORK = 1 << 23


def attention_rows(case, inputs: dict) -> tuple[int, int]:
    """``(query rows, work per row)`` of an attention case: rows in the flattened order of
    :func:`~qsfa.reference.attention.only_rows`, work = heads x selected tokens per row."""
    params = case.call_params(inputs)
    if "query" not in inputs:  # V4 shared-KV: q, layout_q; a window plus the compressed tokens per row
        q = inputs["q"]
        rows = int(np.prod(q.shape[:2])) if (params.get("layout_q") or "BSND") == "BSND" else int(q.shape[0])
        idx, cmp = inputs.get("cmp_sparse_indices"), inputs.get("cmp_kv")
        win = int(params.get("ori_win_left", -1))
        width = (win + 1 if win >= 0 else int(np.prod(inputs["ori_kv"].shape[:2]))) + (
            int(idx.shape[-1]) if idx is not None else int(np.prod(cmp.shape[:2])) if cmp is not None else 0)
        return rows, int(q.shape[-2]) * width
    q = inputs["query"]
    layout = params.get("layout_query") or "BSND"
    rows = int(np.prod(q.shape[:2])) if layout == "BSND" else int(q.shape[0])
    idx = inputs.get("sparse_indices")
    sbs = int(params.get("sparse_block_size") or 1)
    width = int(idx.shape[-1]) * sbs if idx is not None else 1
    return rows, int(q.shape[-2]) * width


def _rows_per_task(case, inputs: dict, chunk_rows: int | None) -> tuple[int, int]:
    rows, work = attention_rows(case, inputs)
    per = chunk_rows if chunk_rows is not None else max(1, ROW_TASK_WORK // max(work, 1))
    return rows, per


def _failure(case, e: BaseException) -> dict:
    from ..golden.manifest import case_error

    return {"kind": "error", "message": str(case_error(case, e))}


def _read_files(folder: str, entry: dict) -> dict:
    files = {}
    for rel in entry["files"]:
        with open(os.path.join(folder, rel), "rb") as f:
            files[rel] = f.read()
    return files


def case_task(case, file_format: str, chunk_rows: int | None):
    """On a worker: the case's manifest entry and file bytes, or (a long attention case) its inputs to be
    split into row tasks, or the deterministic error."""
    from ..golden.manifest import _write_case

    try:
        inputs = case.inputs()
        if case.op in ROW_SPLIT_OPS and chunk_rows != 0:
            rows, per = _rows_per_task(case, inputs, chunk_rows)
            if rows > per:
                return {"kind": "split", "inputs": inputs, "rows": rows, "per": per}
        tmp = tempfile.mkdtemp(prefix="qsfa-golden-")
        try:
            entry = _write_case(case, tmp, file_format, inputs=inputs)
            return {"kind": "files", "entry": entry, "files": _read_files(tmp, entry)}
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except (MemoryError, OSError):
        raise  # may pass on another worker: Dask retries
    except Exception as e:  # noqa: BLE001 - deterministic: reported once by the client
        return _failure(case, e)


def rows_task(case, split: dict, start: int, stop: int):
    """On a worker: rows ``[start, stop)`` of every output of an attention case (``{name: (shape, rows)}``;
    an output with no elements, e.g. the LSE when not requested, whole)."""
    from ..reference.attention import only_rows

    try:
        n = split["rows"]
        with only_rows(start, stop):
            outputs = case.run("reference", split["inputs"])
        return {"kind": "rows", "outputs": {k: (v.shape, v if v.size == 0 else v.reshape(n, -1)[start:stop].copy())
                                            for k, v in outputs.items()}}
    except (MemoryError, OSError):
        raise
    except Exception as e:  # noqa: BLE001
        return _failure(case, e)


def assemble(parts: dict) -> dict:
    """The outputs of a case from its row tasks' results (``{start: outputs}``)."""
    starts = sorted(parts)
    out = {}
    for name, (shape, first) in parts[starts[0]]["outputs"].items():
        if first.size == 0 and int(np.prod(shape)) == 0:
            out[name] = first.reshape(shape)
            continue
        out[name] = np.concatenate([parts[s]["outputs"][name][1] for s in starts], axis=0).reshape(shape)
    return out


def _with_loaded_inputs(case):
    """``case`` with the arrays of its input files (a loaded case file) held in memory, otherwise as it is."""
    if case.inputs_given is not None or not case.has_explicit_inputs:
        return case
    import dataclasses

    return dataclasses.replace(case, inputs_given=case.inputs(), _refs=None)


def _safe_rel(rel: str) -> bool:
    parts = rel.replace("\\", "/").split("/")
    return not os.path.isabs(rel) and ".." not in parts and "" not in parts


class GoldenExecutor:
    """The ``executor`` of :func:`qsfa.golden.manifest.generate` on a Dask ``client``.

    ``chunk_rows``: query rows per row task of a long attention case (None: about :data:`ROW_TASK_WORK`
    units each; 0: never split). After a run, ``summary`` is the :class:`~qsfa.distributed.RunSummary`
    and ``failed_case`` the case file saved for a failure (or None).
    """

    def __init__(self, client, *, chunk_rows: int | None = None, progress: bool = True):
        if chunk_rows is not None and (isinstance(chunk_rows, bool) or int(chunk_rows) < 0):
            raise ClusterUsageError(f"Invalid value for --chunk-rows, actual: {chunk_rows!r}, reason: must be >= 0.")
        self.client = client
        self.chunk_rows = None if chunk_rows is None else int(chunk_rows)
        self.progress = progress
        self.summary = None
        self.failed_case = None
        self.row_tasks = 0

    def _fail(self, case, message: str, out: str):
        from ..golden.io import GoldenInputError

        folder = os.path.abspath(out).rstrip(os.sep) + ".failed"
        try:
            self.failed_case = case.save(os.path.join(folder, case.name + ".json"))
            message += (f" (case file: {self.failed_case}; replay: qsfa golden generate --case {self.failed_case} "
                        "--out DIR)")
        except Exception as e:  # noqa: BLE001 - report the failure itself regardless
            message += f" (could not save its case file: {type(e).__name__}: {e})"
        return GoldenInputError(message)

    def __call__(self, cases, staging: str, file_format: str, made: list | None = None, out: str | None = None) -> list:
        """Write the cases' files into ``staging`` (generate's staging folder inside ``out``, swapped in when
        every case is written, as a serial run's); ``out``: the destination, beside which a failed case's file
        is saved (default: ``staging``). ``made``: every file and folder written is appended."""
        from ..golden.io import GoldenInputError
        from ..golden.manifest import _write_case, case_error

        made = [] if made is None else made
        out = staging if out is None else out
        # a case file's explicit inputs are read here: the workers may not see this machine's files
        cases = [_with_loaded_inputs(c) for c in cases]
        entries: list = [None] * len(cases)
        tasks = Tasks(self.client, "generate", self.progress)
        splits: dict = {}  # case index -> (split future, split dict, {start: rows result}, expected count)
        try:
            for i, c in enumerate(cases):
                # attention cases first (the long ones); row tasks before other cases (a split case waits on them)
                tasks.submit(case_task, c, file_format, self.chunk_rows, label=f"case-{c.name}", tag=("case", i, 0),
                             priority=int(c.op in ROW_SPLIT_OPS))
            for (kind, i, start), fut in tasks.completed():
                c = cases[i]
                try:
                    res = fut.result()
                except Exception as e:  # noqa: BLE001 - the cluster gave up (KilledWorker, retries exhausted)
                    raise self._fail(c, f"case {c.name}: the cluster could not run its {kind} task: "
                                        f"{type(e).__name__}: {e}", out) from e
                if res["kind"] == "error":
                    raise self._fail(c, res["message"], out)
                if res["kind"] == "files":
                    entries[i] = self._write_files(staging, res, made)
                elif res["kind"] == "split":
                    rows, per = res["rows"], res["per"]
                    starts = list(range(0, rows, per))
                    splits[i] = (fut, res, {}, len(starts))
                    for a in starts:
                        b = min(rows, a + per)
                        tasks.submit(rows_task, c, fut, a, b, label=f"rows-{c.name}-{a}-{b}", tag=("rows", i, a),
                                     priority=2)
                        self.row_tasks += 1
                else:  # rows
                    split_fut, split, parts, count = splits[i]
                    parts[start] = res
                    if len(parts) == count:
                        del splits[i]
                        try:
                            entries[i] = _write_case(c, staging, file_format, inputs=split["inputs"],
                                                     outputs=assemble(parts), made=made)
                        except (MemoryError, OSError):
                            raise
                        except Exception as e:  # noqa: BLE001
                            raise self._fail(c, str(case_error(c, e)), out) from e
                del fut, res
        except BaseException:
            tasks.cancel()
            raise
        finally:
            tasks.close()
        self.summary = tasks.summary()
        missing = [c.name for c, e in zip(cases, entries) if e is None]
        if missing:  # cannot happen unless a task vanished: never write a manifest without its cases
            raise GoldenInputError(f"cases {missing} were not computed")
        return entries

    @staticmethod
    def _write_files(out: str, res: dict, made: list) -> dict:
        from ..golden.io import GoldenInputError
        from ..golden.manifest import write_case_files

        entry = res["entry"]
        for rel in res["files"]:
            if not _safe_rel(rel) or rel not in entry["files"]:
                raise GoldenInputError(f"a worker returned file {rel!r}, which is not in its case's entry")
        # new files in plain case folders only (no links followed, nothing overwritten), as a serial run
        write_case_files(out, res["files"], made)
        return entry
