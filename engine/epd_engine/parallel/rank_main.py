"""``python -m epd_engine.parallel.rank_main RANK SIZE STORE_PORT PARENT_PID``: one of ranks
1..N-1 of a tensor-parallel instance, started by rank 0 (``ranks.py``). It loads its slice of
the language model, sizes its caches as rank 0 says, then makes rank 0's calls until told to
stop. It exits when rank 0 does (even killed): nothing else would ever call it again."""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from epd_engine.config import EngineConfig
from epd_engine.model.attention_select import attention_backend_for
from epd_engine.model.loader import load_language
from epd_engine.model.registry import family_of
from epd_engine.parallel.follower import RankFollower
from epd_engine.parallel.ranks import CONFIG_KEY, arrived, join, rank_device
from epd_engine.parallel.sharding import shard_config
from epd_engine.transfer.memory import dtype_of
from epd_engine.worker.model_runner import ModelRunner

log = logging.getLogger("epd_engine.rank")


def main(argv: list[str]) -> int:
    rank, size, port, parent = (int(a) for a in argv)
    logging.basicConfig(level=logging.INFO, format=f"rank {rank}: %(levelname)s %(message)s")
    _exit_with(parent)
    store = dist.TCPStore("127.0.0.1", port, world_size=size, is_master=False,
                          timeout=timedelta(seconds=60))  # fmt: skip
    arrived(store, rank)
    config: EngineConfig = pickle.loads(store.get(CONFIG_KEY))
    if config.device == "cpu":
        torch.set_num_threads(config.cpu_threads)
    model_config = family_of(config.model_dir).load_config(config.model_dir)
    tp, calls = join(store, rank, config, model_config.vocab_size)
    device = rank_device(config.device, rank)
    dtype = dtype_of(config.dtype)
    attention = attention_backend_for(
        config.attention_backend, shard_config(model_config, tp.shard), dtype, device
    )
    language = load_language(config.model_dir, dtype, device, attention, tp)
    follower = RankFollower(tp, calls, torch.device(device))
    setup = follower.setup()
    runner = ModelRunner(
        None, language, setup.shape, dtype, device, with_image_cache=False,
        max_decode_seqs=setup.max_decode_seqs, max_model_len=setup.max_model_len,
        dual_stream=False, cuda_graphs=False, ranks=follower,
    )  # fmt: skip
    log.info("ready: %s of %d", device, size)
    follower.serve(runner)
    dist.destroy_process_group()
    return 0


def _exit_with(parent: int) -> None:
    """Exit as soon as rank 0's process is gone (a killed rank 0 cannot say stop)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="epd-parent", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
