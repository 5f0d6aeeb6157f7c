"""benchmarks/layer_power.py: its reading of nvidia-smi samples and their attribution to an
arm's passes. The measurement itself needs GPUs (benchmarks/RESULTS.md)."""

from benchmarks.layer_power import parse_sample, phase_stats, smi_index_by_uuid


def test_parse_sample_reads_the_power_cap_bit():
    assert parse_sample("0, 1605, 596.31, 0x0000000000000004\n") == (0, 1605.0, 596.31, True)
    assert parse_sample("1, 1980, 80.2, 0x0000000000000000") == (1, 1980.0, 80.2, False)
    # Another reason alone (0x1: idle) is not the power cap.
    assert parse_sample("1, 345, 70.0, 0x0000000000000001")[3] is False


def test_parse_sample_skips_lines_it_cannot_read():
    assert parse_sample("0, [N/A], 500.0, 0x4") is None
    assert parse_sample("garbage") is None


def test_phase_stats_keeps_one_gpu_inside_the_window_after_the_ramp():
    samples = [
        (9.0, 0, 1980.0, 100.0, False),  # before the passes
        (10.1, 0, 1900.0, 650.0, False),  # ramp-up, skipped
        (10.5, 0, 1600.0, 600.0, True),
        (10.6, 1, 1000.0, 999.0, True),  # the other GPU
        (11.0, 0, 1700.0, 620.0, True),
        (11.5, 0, 1800.0, 640.0, False),
        (12.5, 0, 1980.0, 90.0, False),  # after
    ]
    stats = phase_stats(samples, 0, 10.0, 12.0, skip_s=0.3)
    assert stats == {"samples": 3, "sm_mhz": 1700, "power_w": 620, "power_capped": 0.67}
    assert phase_stats(samples, 2, 10.0, 12.0, skip_s=0.3)["samples"] == 0


def test_smi_index_by_uuid_maps_torch_uuids_to_nvidia_smi_indices():
    text = ("0, GPU-50919755-736b-af4c-5e43-836a4aa19c42\n"
            "1, GPU-30ce921e-2af1-e69d-d690-95273369cd60\n")
    # torch's device UUID has no "GPU-" prefix.
    assert smi_index_by_uuid(text) == {"50919755-736b-af4c-5e43-836a4aa19c42": 0,
                                       "30ce921e-2af1-e69d-d690-95273369cd60": 1}
