"""Pictures for people: a grid of test digits with what the model predicted."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image, ImageDraw

CELL = 56  # pixels per digit: 28x28 doubled
CAPTION = 14


def prediction_grid(images: torch.Tensor, predicted: torch.Tensor, truth: torch.Tensor,
                    columns: int = 8) -> torch.Tensor:
    """uint8 RGB [H, W, 3]: each digit with "pred/true" under it, red where they differ."""
    rows = -(-len(images) // columns)
    canvas = Image.new("RGB", (columns * CELL, rows * (CELL + CAPTION)), "black")
    draw = ImageDraw.Draw(canvas)
    for i, (image, p, t) in enumerate(zip(images, predicted.tolist(), truth.tolist())):
        x, y = (i % columns) * CELL, (i // columns) * (CELL + CAPTION)
        digit = Image.fromarray(image.cpu().numpy()).resize((CELL, CELL), Image.NEAREST)
        canvas.paste(digit.convert("RGB"), (x, y))
        draw.text((x + 4, y + CELL), f"{p}/{t}", fill=(80, 220, 80) if p == t else (255, 70, 70))
    return torch.from_numpy(np.asarray(canvas).copy())
