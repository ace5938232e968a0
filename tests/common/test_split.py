"""Split GGUFs (`NAME-0000k-of-0000n.gguf`): the layout of a split model equals the single file's,
our writer's parts equal gguf-py's own `GGUFWriter` split of the same model, and a missing,
truncated or foreign part is refused in one line naming it (layout, `moestream inspect`, the daemon)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from moestream.authoring.make_model import make_model
from moestream.common.layout import ModelFormatError, ModelLayout

MODEL = dict(arch="qwen3moe", quant="Q8_0", layers=3, experts=8, seed=3)
SPLIT = 40_000  # bytes of tensors per part: each expert tensor (33 KiB) lands in a part of its own


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("split")
    (root / "one").mkdir()
    (root / "parts").mkdir()
    return {"single": make_model(root / "one" / "m.gguf", **MODEL),
            "split": make_model(root / "parts" / "m.gguf", split_max_size=SPLIT, **MODEL)}


def parts_of(first: Path) -> list[Path]:
    return sorted(first.parent.glob("m-*-of-*.gguf"))


def copy_parts(models: dict, dest: Path) -> list[Path]:
    """A private copy of the split model's parts, to break."""
    dest.mkdir()
    return [Path(shutil.copy(p, dest / p.name)) for p in parts_of(models["split"])]


def test_split_layout_equals_the_single_files(models):
    parts = parts_of(models["split"])
    one = ModelLayout(models["single"])
    assert models["split"].name == "m-00001-of-%05d.gguf" % len(parts) and len(parts) >= 5
    for given in (parts[0], parts[len(parts) // 2], parts[-1]):  # any part opens the whole model
        lay = ModelLayout(given)
        assert [f.path for f in lay.files] == parts and lay.path == parts[0]
        assert lay.file_size == sum(p.stat().st_size for p in parts)
        assert sum(f.n_tensors for f in lay.files) == len(one.tensors)
        assert lay.hparams == one.hparams and lay.experts.summary() == one.experts.summary()
        assert {n: (t.qtype, t.shape, t.nbytes) for n, t in lay.tensors.items()} == \
               {n: (t.qtype, t.shape, t.nbytes) for n, t in one.tensors.items()}
        for name in one.tensors:
            assert np.array_equal(lay.tensor_bytes(name), one.tensor_bytes(name)), name
    spread = False
    for layer in lay.experts.moe_layers:
        for e in range(lay.hparams.n_expert):
            mine, ref = lay.experts.parts(layer, e), one.experts.parts(layer, e)
            assert [(p.name, p.qtype, p.shape, p.nbytes) for p in mine] == [(p.name, p.qtype, p.shape, p.nbytes) for p in ref]
            for p, q in zip(mine, ref):  # read here from the part file itself, not through the layout's map
                with open(lay.files[p.file].path, "rb") as f:
                    f.seek(p.offset)
                    assert f.read(p.nbytes) == bytes(one.bytes_of(q))
            spread |= len({p.file for p in mine}) == 3
    assert spread, "gate, up and down of one expert should lie in three different parts"


def test_fingerprint_covers_every_part(models, tmp_path):
    first = ModelLayout(models["split"]).fingerprint
    assert ModelLayout(parts_of(models["split"])[-1]).fingerprint.identity() == first.identity()
    assert first.size == sum(p.stat().st_size for p in parts_of(models["split"]))
    assert first.identity() != ModelLayout(models["single"]).fingerprint.identity()
    parts = copy_parts(models, tmp_path / "edit")
    last = parts[-1]
    data = bytearray(last.read_bytes())
    data[-100] ^= 0xFF  # one byte of the last part's data: the sample reaches every part
    last.write_bytes(bytes(data))
    assert ModelLayout(parts[0]).fingerprint.identity() != first.identity()


def _gguf_py_split(src: Path, out: Path, max_size: int, small_first_shard: bool = False) -> list[Path]:
    """gguf-py's own writer splitting `src` (metadata and tensors copied as stored); with
    `small_first_shard`, the first part holds metadata only (gguf-split's --no-tensor-first-split)."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(out, str(r.get_field("general.architecture").contents()), split_max_size=max_size,
                        small_first_shard=small_first_shard)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), vtype, sub_type=sub)
    for t in r.tensors:
        q = gguf.GGMLQuantizationType(t.tensor_type)
        raw = q not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
        w.add_tensor(t.name, np.array(t.data), raw_dtype=q if raw else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return w.format_shard_names(out)


def test_parts_equal_gguf_pys_own_split(models, tmp_path):
    (tmp_path / "ref").mkdir()
    ref = _gguf_py_split(models["single"], tmp_path / "ref" / "m.gguf", SPLIT)
    ours = parts_of(models["split"])
    assert [p.name for p in ref] == [p.name for p in ours]
    for a, b in zip(ref, ours):
        assert a.read_bytes() == b.read_bytes(), a.name
    lay = ModelLayout(ref[1])  # and that split opens as the same model
    assert lay.fingerprint.identity() == ModelLayout(ours[0]).fingerprint.identity()


def test_a_first_part_without_tensors_opens(models, tmp_path):
    parts = _gguf_py_split(models["single"], tmp_path / "m.gguf", SPLIT, small_first_shard=True)
    lay, one = ModelLayout(parts[-1]), ModelLayout(models["single"])
    assert lay.files[0].n_tensors == 0 and len(lay.files) == len(parts_of(models["split"])) + 1
    assert lay.hparams == one.hparams
    for layer in lay.experts.moe_layers:
        for p, q in zip(lay.experts.parts(layer, 1), one.experts.parts(layer, 1)):
            assert p.file > 0 and np.array_equal(lay.bytes_of(p), one.bytes_of(q))


def test_a_model_that_fits_one_part_is_one_file(tmp_path):
    path = make_model(tmp_path / "m.gguf", split_max_size="1GiB", **MODEL)
    assert path == tmp_path / "m.gguf" and [p.name for p in tmp_path.iterdir()] == ["m.gguf"]
    assert len(ModelLayout(path).files) == 1


def _rewrite(part: Path, drop_last: bool = False, tensors_from: Path | None = None,
             extra: dict | None = None) -> None:
    """Write `part` again with gguf-py: its split keys, its tensors (optionally the last dropped, or
    those of the same names taken from `tensors_from`, another model), plus `extra` string keys."""
    r = gguf.GGUFReader(part)
    other = {t.name: t for t in gguf.GGUFReader(tensors_from).tensors} if tensors_from else {}
    w = gguf.GGUFWriter(None, "qwen3moe")
    w.kv_data[0].clear()  # later parts carry the split keys only
    w.add_uint16("split.no", int(r.get_field("split.no").contents()))
    w.add_uint16("split.count", int(r.get_field("split.count").contents()))
    w.add_int32("split.tensors.count", int(r.get_field("split.tensors.count").contents()))
    for key, value in (extra or {}).items():
        w.add_string(key, value)
    tensors = r.tensors[:-1] if drop_last else r.tensors
    for t in tensors:
        t = other.get(t.name, t)
        w.add_tensor(t.name, np.array(t.data), raw_dtype=gguf.GGMLQuantizationType(t.tensor_type))
    tmp = part.with_suffix(".tmp")
    w.write_header_to_file(tmp)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(part)


def _broken(kind: str, models: dict, parts: list[Path], tmp_path: Path) -> tuple[Path, str]:
    """Break the copied split in one way; returns (the part to blame, text the error must hold)."""
    victim = parts[2]
    if kind == "missing":
        victim.unlink()
        return victim, "missing part 3 of"
    if kind == "truncated":
        victim.write_bytes(victim.read_bytes()[:-5000])
        return victim, "truncated"
    if kind == "renumbered":  # part 4 copied over part 3
        shutil.copy(parts[3], victim)
        return victim, f"the name says part 3 of {len(parts)} but its metadata says part 4"
    if kind == "other_split":  # part 3 of the same model split in fewer parts
        (tmp_path / "coarse").mkdir()
        coarse = make_model(tmp_path / "coarse" / "m.gguf", split_max_size=SPLIT * 2, **MODEL)
        other = parts_of(coarse)
        shutil.copy(other[2], victim)
        return victim, f"split.count={len(other)}"
    if kind == "short_table":  # the part's split keys are right but it lost a tensor
        _rewrite(parts[1], drop_last=True)
        return parts[0], "split.tensors.count"
    if kind == "other_model_kv":
        _rewrite(victim, extra={"general.architecture": "llama"})
        return victim, "a part of another model: general.architecture='llama'"
    if kind == "other_model_tensors":  # the same tensor names from a model with wider experts
        (tmp_path / "wide").mkdir()
        wide = make_model(tmp_path / "wide" / "m.gguf", **{**MODEL, "expert_ff": 96})
        _rewrite(victim, tensors_from=wide)
        return victim, "mis-shaped expert tensor"
    raise AssertionError(kind)


KINDS = ["missing", "truncated", "renumbered", "other_split", "short_table", "other_model_kv", "other_model_tensors"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_bad_part_is_refused_in_one_line_naming_it(models, tmp_path, kind):
    parts = copy_parts(models, tmp_path / "m")
    blame, text = _broken(kind, models, parts, tmp_path)
    for given in (parts[0], parts[-1]):
        with pytest.raises(ModelFormatError) as e:
            ModelLayout(given)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(blame.name) and text in msg, msg


def test_inspect_lists_the_parts_and_refuses_a_missing_one(models, tmp_path):
    cmd = [sys.executable, "-m", "moestream", "inspect"]
    parts = parts_of(models["split"])
    out = subprocess.run([*cmd, str(parts[1]), "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert [(f["path"], f["bytes"]) for f in info["files"]] == [(str(p), p.stat().st_size) for p in parts]
    assert sum(f["tensors"] for f in info["files"]) == len(gguf.GGUFReader(models["single"]).tensors)
    assert info["file_bytes"] == sum(p.stat().st_size for p in parts) and info["path"] == str(parts[0])
    text = subprocess.run([*cmd, str(parts[0])], capture_output=True, text=True, timeout=60).stdout
    assert f"split            {len(parts)} parts" in text
    for p in parts:
        assert f"{p}  {p.stat().st_size:,} B" in text
    broken = copy_parts(models, tmp_path / "m")
    broken[3].unlink()
    out = subprocess.run([*cmd, str(broken[0])], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines() == [f"moestream inspect: {broken[3].name}: missing part 4 of {len(broken)} "
                                               f"of the split model (looked beside {broken[0].name} in {broken[0].parent})"]


@pytest.mark.parametrize("kind", ["other_split", "short_table", "other_model_tensors"])
def test_the_commands_refuse_a_bad_part_in_one_line(models, tmp_path, kind):
    parts = copy_parts(models, tmp_path / "m")
    blame, text = _broken(kind, models, parts, tmp_path)
    sock = f"ipc://{tmp_path}/iod"
    for prog, code, cmd in (("moestream inspect", 1, ["-m", "moestream", "inspect", str(parts[-1])]),
                            ("moestream-iod: error", 2, ["-m", "moestream.iod.main", "--model", str(parts[-1]),
                                                         "--endpoint", f"{sock}.sock", "--status-endpoint",
                                                         f"{sock}-s.sock"])):  # the daemon: 2, a configuration error
        out = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=60)
        assert out.returncode == code and "Traceback" not in out.stderr, out.stderr
        (line,) = out.stderr.strip().splitlines()
        assert line.startswith(f"{prog}: {blame.name}: ") and text in line, line


def test_parts_linked_from_a_hub_cache_are_found_by_their_link_names(models, tmp_path):
    """A Hugging Face cache: snapshots/REV/NAME-0000k-of-0000n.gguf are links to blobs/<hash>."""
    (tmp_path / "blobs").mkdir()
    (tmp_path / "snap").mkdir()
    for i, p in enumerate(parts_of(models["split"])):
        blob = Path(shutil.copy(p, tmp_path / "blobs" / f"{i:064x}"))
        (tmp_path / "snap" / p.name).symlink_to(Path("..") / "blobs" / blob.name)
    links = sorted((tmp_path / "snap").iterdir())
    lay = ModelLayout(links[2])
    assert [f.path for f in lay.files] == links
    assert lay.fingerprint.identity() == ModelLayout(models["split"]).fingerprint.identity()


def test_single_files_are_untouched(models):
    lay = ModelLayout(models["single"])
    assert len(lay.files) == 1 and lay.files[0].path == lay.path and lay.file_size == lay.path.stat().st_size
    assert all(t.file == 0 for t in lay.tensors.values())
