"""Where the numbers go: TensorBoard on rank 0, nowhere on the other ranks."""

from __future__ import annotations

from pathlib import Path


class NullMetrics:
    """What ranks that must not write get: every method does nothing."""

    def scalars(self, step: int, values: dict[str, float]) -> None:
        pass

    def text(self, tag: str, text: str, step: int = 0) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardMetrics(NullMetrics):
    """Scalars and text in ``run_dir``; steps from ``purge_step`` on are rewritten, not duplicated."""

    def __init__(self, run_dir: Path, purge_step: int | None = None):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir), purge_step=purge_step)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        self.writer.add_text(tag, text, global_step=step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
