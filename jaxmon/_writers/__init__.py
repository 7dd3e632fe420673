"""Summary writers: the protocol (`interface`), one writer per module, and the cache
that lets hooks writing to one directory share one writer."""

from jaxmon._writers.cache import MultiWriter, SummaryWriterCache, default_writer
from jaxmon._writers.interface import SummaryWriter, restart
from jaxmon._writers.jsonl import JsonlWriter
from jaxmon._writers.mlflow_runs import MlflowWriter
from jaxmon._writers.slot import WriterSlot, flush_all
from jaxmon._writers.tensorboard import TensorBoardWriter
from jaxmon._writers.wandb_runs import WandbWriter

__all__ = ["JsonlWriter", "MlflowWriter", "MultiWriter", "SummaryWriter", "SummaryWriterCache", "TensorBoardWriter",
           "WandbWriter", "WriterSlot", "default_writer", "flush_all", "restart"]
