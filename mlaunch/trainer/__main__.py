"""``python -m mlaunch.trainer``: the entry point torchrun starts on every rank."""

import logging
import os
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from mlaunch.trainer.loop import main

if __name__ == "__main__":
    # record(): torchelastic's error file gets this rank's exception and traceback.
    # record() turns SystemExit(0) (argparse's --help) into a return of None.
    code = record(main)() or 0
    # A clean end leaves without interpreter finalisation. gloo's (and NCCL's) worker threads
    # release each collective's tensors after wait() has returned, and with torch's PyObject
    # preservation that release takes the GIL; a release still pending when the interpreter
    # finalises kills that C++ thread mid-unwind and the whole process aborts ("terminate called
    # without an active exception", SIGABRT) after a successful run, about 1 DP=2 run in 5 here.
    # Everything the trainer writes is closed by main() (telemetry.shutdown included), so only
    # the standard streams and logging need flushing.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
