"""How a checkpoint is cut across tensor-parallel ranks, and which sizes are refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from epd_engine.config import EngineConfig, Role
from epd_engine.model.registry import load_model_config
from epd_engine.parallel.ranks import rank_device
from epd_engine.parallel.sharding import Shard, check_divisible, divisors_of, shard_config


def test_fused_projections_are_cut_part_by_part():
    """q, k and v (gate and up) each give the rank its heads' rows: cutting the fused
    tensor as one would hand rank 0 all of q and rank 1 k and v."""
    q, k, v = (
        torch.arange(8.0)[:, None],
        torch.arange(10.0, 14.0)[:, None],
        torch.arange(20.0, 24.0)[:, None],
    )
    rank1 = Shard(1, 2, vocab_size=10).cut("layers.0.self_attn.qkv_proj.weight", [q, k, v])
    assert [p.flatten().tolist() for p in rank1] == [[4, 5, 6, 7], [12, 13], [22, 23]]


def test_row_parallel_layers_are_cut_by_column():
    weight = torch.arange(8.0).view(2, 4)
    (cut,) = Shard(1, 2, vocab_size=10).cut("layers.3.mlp.down_proj.weight", [weight])
    assert cut.tolist() == [[2.0, 3.0], [6.0, 7.0]]


def test_vocabulary_is_padded_on_the_last_rank():
    table = torch.arange(5.0)[:, None].expand(5, 3)
    first = Shard(0, 2, vocab_size=5).cut("embed_tokens.weight", [table])[0]
    last = Shard(1, 2, vocab_size=5).cut("lm_head.weight", [table])[0]
    assert first[:, 0].tolist() == [0, 1, 2]
    assert last[:, 0].tolist() == [3, 4, 0]  # a padding row of zeros: never the argmax input
    assert last.shape == (3, 3)


def test_norms_and_the_rest_stay_whole():
    weight = torch.ones(4)
    assert Shard(1, 2, 10).cut("layers.0.input_layernorm.weight", [weight])[0] is weight


def test_shard_config_divides_heads_width_and_vocabulary(tiny_model_dir):
    config = load_model_config(tiny_model_dir)
    rank = shard_config(config, Shard(0, 2, config.vocab_size))
    assert (rank.num_heads, rank.num_kv_heads) == (config.num_heads // 2, config.num_kv_heads // 2)
    assert rank.intermediate_size == config.intermediate_size // 2
    assert rank.vocab_size == -(-config.vocab_size // 2)
    assert (rank.head_dim, rank.hidden_size) == (config.head_dim, config.hidden_size)


def test_sizes_that_do_not_divide_the_heads_are_refused_by_name(tiny_model_dir):
    config = load_model_config(tiny_model_dir)  # 4 query heads, 2 KV heads
    assert divisors_of(config) == [1, 2]
    with pytest.raises(ValueError, match=r"does not divide the model's num_kv_heads \(2\).*1, 2"):
        check_divisible(config, 4)
    with pytest.raises(ValueError, match="must be one of"):
        check_divisible(dataclasses.replace(config, num_kv_heads=4), 3)


def test_an_encoder_is_refused_every_role_with_a_language_model_is_taken(tmp_path):
    with pytest.raises(ValueError, match="does not run"):
        EngineConfig(model_dir=tmp_path, role=Role.E, tensor_parallel_size=2)
    for role in (Role.P, Role.D, Role.EP, Role.ED, Role.PD, Role.EPD):
        assert EngineConfig(model_dir=tmp_path, role=role, tensor_parallel_size=2)


def test_async_scheduling_is_off_with_ranks_and_refused_when_asked(tmp_path):
    assert not EngineConfig(
        model_dir=tmp_path, device="cuda", tensor_parallel_size=2
    ).async_scheduling
    with pytest.raises(ValueError, match="async_scheduling is not supported"):
        EngineConfig(model_dir=tmp_path, tensor_parallel_size=2, async_scheduling=True)
    with pytest.raises(ValueError, match="must be one of 1, 2, 4, 8"):
        EngineConfig(model_dir=tmp_path, tensor_parallel_size=3)


def test_each_rank_takes_the_next_gpu():
    assert [rank_device("cuda", r) for r in range(2)] == ["cuda:0", "cuda:1"]
    assert rank_device("cuda:4", 3) == "cuda:7"
    assert rank_device("cpu", 1) == "cpu"


def test_a_one_gpu_check_puts_every_rank_on_the_instance_gpu(monkeypatch):
    monkeypatch.setenv("EPD_TP_SHARE_DEVICE", "1")
    assert rank_device("cuda", 1) == "cuda"
    assert rank_device("cuda:2", 3) == "cuda:2"
