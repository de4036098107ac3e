import numpy as np
import pytest

from fusionrag.retriever.engine.vectors import open_vectors, write_bin, write_vecs
from fusionrag.retriever.errors import VectorFileError


@pytest.mark.parametrize("ext,dtype", [(".fbin", np.float32), (".u8bin", np.uint8), (".i8bin", np.int8),
                                        (".ibin", np.int32)])
def test_bin_round_trip(tmp_path, ext, dtype):
    arr = (np.arange(7 * 5) % 100).reshape(7, 5).astype(dtype)
    write_bin(tmp_path / f"v{ext}", arr)
    v = open_vectors(tmp_path / f"v{ext}")
    assert (v.count, v.dim, v.dtype) == (7, 5, np.dtype(dtype))
    assert isinstance(v.data, np.memmap)
    np.testing.assert_array_equal(v[:], arr)
    np.testing.assert_array_equal(v[np.array([6, 1])], arr[[6, 1]])


@pytest.mark.parametrize("ext,dtype", [(".fvecs", np.float32), (".bvecs", np.uint8), (".ivecs", np.int32)])
def test_texmex_round_trip(tmp_path, ext, dtype):
    arr = (np.arange(9 * 3) % 200).reshape(9, 3).astype(dtype)
    write_vecs(tmp_path / f"v{ext}", arr)
    v = open_vectors(tmp_path / f"v{ext}")
    assert (v.count, v.dim, v.dtype) == (9, 3, np.dtype(dtype))
    np.testing.assert_array_equal(v[:], arr)
    np.testing.assert_array_equal(v[2:4], arr[2:4])


def test_npy_is_memory_mapped(tmp_path):
    arr = np.random.default_rng(0).standard_normal((10, 4)).astype(np.float32)
    np.save(tmp_path / "v.npy", arr)
    v = open_vectors(tmp_path / "v.npy")
    assert isinstance(v.data, np.memmap)
    np.testing.assert_array_equal(v[:], arr)


def test_real_sift_file(data_dir):
    v = open_vectors(data_dir / "sift5k-ngt-texmexq" / "sift5k_base.fvecs")
    assert (v.count, v.dim) == (5000, 128)
    gt = open_vectors(data_dir / "sift5k-ngt-texmexq" / "sift5k_groundtruth.ivecs")
    assert gt.shape if hasattr(gt, "shape") else (gt.count, gt.dim) == (100, 100)


def test_bad_files(tmp_path):
    (tmp_path / "empty.fbin").write_bytes(b"")
    with pytest.raises(VectorFileError, match="empty file"):
        open_vectors(tmp_path / "empty.fbin")
    write_bin(tmp_path / "t.fbin", np.ones((10, 4), np.float32))
    data = (tmp_path / "t.fbin").read_bytes()
    (tmp_path / "t.fbin").write_bytes(data[:-3])
    with pytest.raises(VectorFileError, match="truncated"):
        open_vectors(tmp_path / "t.fbin")
    (tmp_path / "neg.u8bin").write_bytes(np.array([-1, 4], "<i4").tobytes())
    with pytest.raises(VectorFileError, match="must be positive"):
        open_vectors(tmp_path / "neg.u8bin")
    write_vecs(tmp_path / "a.fvecs", np.ones((3, 4), np.float32))
    write_vecs(tmp_path / "b.fvecs", np.ones((2, 2), np.float32))
    (tmp_path / "mixed.fvecs").write_bytes((tmp_path / "a.fvecs").read_bytes() + (tmp_path / "b.fvecs").read_bytes())
    with pytest.raises(VectorFileError, match="truncated or mixed|different dimensions"):
        open_vectors(tmp_path / "mixed.fvecs")
    with pytest.raises(VectorFileError, match="unknown vector file extension"):
        open_vectors(tmp_path / "x.csv")
    with pytest.raises(VectorFileError, match="cannot read"):
        open_vectors(tmp_path / "missing.fbin")
    np.save(tmp_path / "one_d.npy", np.ones(5, np.float32))
    with pytest.raises(VectorFileError, match="2-D"):
        open_vectors(tmp_path / "one_d.npy")
