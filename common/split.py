"""The files of a model: one GGUF, or the parts of a split one, found, opened and checked.

llama.cpp's `gguf-split` and gguf-py's `GGUFWriter(split_max_size=...)` (what
`convert_hf_to_gguf.py --split-max-size` uses) write a model as `NAME-0000k-of-0000n.gguf`:

| key                   | type | in            | value                                  |
|-----------------------|------|---------------|----------------------------------------|
| `split.no`            | u16  | every part    | the part's index, 0-based (name: +1)   |
| `split.count`         | u16  | every part    | n, the number of parts                 |
| `split.tensors.count` | i32  | every part    | tensors in all parts together          |

The first part holds all other metadata (it may hold no tensors: `--no-tensor-first-split`);
later parts hold only the split keys and their own tensor table, offsets relative to their own
data section. Each tensor lies in exactly one part. A part may be named on the command line
by any of them; the others are found beside it by name, as llama.cpp's `llama_split_path` names them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import GGUFReader

SPLIT_NAME = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS = "split.no", "split.count", "split.tensors.count"
_OWN_KEYS = (SPLIT_NO, SPLIT_COUNT, SPLIT_TENSORS)  # differ per part by design; "GGUF.*" are the reader's


class SplitError(ValueError):
    """A part is missing, truncated or does not belong (the layout re-raises it as ModelFormatError)."""


@dataclass(frozen=True)
class ModelFile:
    """One file of the model: the whole model (`index` 0 of 1), or part `index` (= split.no) of a split."""

    index: int
    path: Path
    size: int
    mtime_ns: int
    n_tensors: int
    data_offset: int  # where its tensor data section begins


def part_path(stem: str, directory: Path, no: int, count: int) -> Path:
    """Part `no` (0-based) of `count`, named as llama.cpp names it."""
    return directory / f"{stem}-{no + 1:05d}-of-{count:05d}.gguf"


def _field(reader: GGUFReader, key: str) -> Any:
    f = reader.get_field(key)
    return None if f is None else f.contents()


def _split_keys(name: str, reader: GGUFReader) -> tuple[int, int, int] | None:
    """(split.no, split.count, split.tensors.count), or None for a file that is not a part of a split."""
    count = _field(reader, SPLIT_COUNT)
    if count is not None and not isinstance(count, int):
        raise SplitError(f"{name}: split.count is {count!r}, not a number")
    if count is None or count <= 1:
        return None
    values = [_field(reader, k) for k in _OWN_KEYS]
    for key, value in zip(_OWN_KEYS, values):
        if not isinstance(value, int):
            raise SplitError(f"{name}: split.count={count} but {key} is {'missing' if value is None else repr(value)}")
    return int(values[0]), int(values[1]), int(values[2])


def part_paths(path: Path, reader: GGUFReader) -> list[Path]:
    """Every part's path, in order, given any one part (and its reader); [path] for a single file."""
    keys = _split_keys(path.name, reader)
    if keys is None:
        return [path]
    no, count, _ = keys
    m = SPLIT_NAME.match(path.name)
    if m is None:
        raise SplitError(f"{path.name}: split.count={count}, but the name is not NAME-{no + 1:05d}-of-{count:05d}.gguf "
                         f"(the other parts are found by that name)")
    if (int(m["no"]), int(m["count"])) != (no + 1, count):
        raise SplitError(f"{path.name}: the name says part {int(m['no'])} of {int(m['count'])} but its metadata says "
                         f"part {no + 1} of {count} (split.no={no}, split.count={count}): a part renamed or copied "
                         f"over another")
    return [part_path(m["stem"], path.parent, i, count) for i in range(count)]


def open_parts(path: Path, open_reader: Callable[[Path], GGUFReader]) -> tuple[list[ModelFile], list[GGUFReader]]:
    """The model's files and their readers (first part first), each checked to belong.

    `path` absolute, its links not resolved: the parts are found by the names they are given
    (a Hugging Face cache links `NAME-0000k-of-0000n.gguf` to blobs named by hash). A single
    file's path is resolved, as it always was. `open_reader` opens one GGUF (raising on a bad
    or truncated file, naming it)."""
    given = open_reader(path)
    paths = part_paths(path, given)
    if len(paths) == 1:
        paths = [path.resolve()]
    readers = []
    for i, p in enumerate(paths):
        if p == path or len(paths) == 1:
            readers.append(given)
            continue
        if not p.is_file():
            raise SplitError(f"{p.name}: missing part {i + 1} of {len(paths)} of the split model "
                             f"(looked beside {path.name} in {p.parent})")
        readers.append(open_reader(p))
    files = [_model_file(i, p, r) for i, (p, r) in enumerate(zip(paths, readers))]
    if len(paths) > 1:
        _check_parts(files, readers)
    return files, readers


def _model_file(index: int, path: Path, reader: GGUFReader) -> ModelFile:
    st = path.stat()
    return ModelFile(index, path, st.st_size, st.st_mtime_ns, len(reader.tensors), int(reader.data_offset))


def _check_parts(files: list[ModelFile], readers: list[GGUFReader]) -> None:
    """Every part says it is part i of n of a model of split.tensors.count tensors, and it is."""
    first = files[0].path.name
    _, count, total = _split_keys(first, readers[0]) or (0, 0, 0)
    for f, r in zip(files, readers):
        keys = _split_keys(f.path.name, r)
        if keys is None:
            raise SplitError(f"{f.path.name}: not a part of a split model (no split.count > 1), "
                             f"but {first} names it as part {f.index + 1} of {count}")
        if keys[1:] == (count, total) and keys[0] != f.index:
            raise SplitError(f"{f.path.name}: the name says part {f.index + 1} of {count} but its metadata says "
                             f"part {keys[0] + 1} (split.no={keys[0]}): a part renamed or copied over another")
        if keys != (f.index, count, total):
            raise SplitError(f"{f.path.name}: a part of another split: split.no={keys[0]}, split.count={keys[1]}, "
                             f"split.tensors.count={keys[2]}; expected {f.index}, {count}, {total} as {first} says")
        _check_metadata(f.path.name, r, readers[0], first)
    held = [f.n_tensors for f in files]
    if sum(held) != total:
        raise SplitError(f"{first}: the parts hold {' + '.join(map(str, held))} = {sum(held)} tensors but "
                         f"split.tensors.count={total} (a part of another split, or a truncated tensor table)")


def _check_metadata(name: str, reader: GGUFReader, first: GGUFReader, first_name: str) -> None:
    """A later part carries only the split keys; any other key it has must agree with the first part's."""
    if reader is first:
        return
    for key in reader.fields:
        if key.startswith("GGUF.") or key in _OWN_KEYS:
            continue
        mine, theirs = _field(reader, key), _field(first, key)
        if theirs is not None and mine != theirs:
            raise SplitError(f"{name}: a part of another model: {key}={_short(mine)} but {first_name} has "
                             f"{_short(theirs)}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
