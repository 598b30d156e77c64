"""``python -m mlaunch.trainer``: the entry point torchrun starts on every rank."""

from torch.distributed.elastic.multiprocessing.errors import record

from mlaunch.trainer.loop import main

if __name__ == "__main__":
    # record(): torchelastic's error file gets this rank's exception and traceback.
    raise SystemExit(record(main)())
