"""Write the bundled `letters` prompt set (miles_runner/plugins/data/letters.jsonl), deterministically.

    python scripts/make_letters_data.py

"How many letters: qzv? Reply with a single number." -> "3": a counting task like `count`, but over the letters
of one made-up word, served as a data set (task `jsonl`, data `bundled:letters.jsonl`) so that the CPU multi-LoRA
recipe exercises per-adapter data files.
"""

import json
import random
import string
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "miles_runner" / "rollout" / "data" / "letters.jsonl"
ROWS, SEED = 256, 7


def rows(count: int = ROWS, seed: int = SEED) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 6)))
        out.append({"prompt": f"How many letters: {word}? Reply with a single number.", "label": str(len(word))})
    return out


if __name__ == "__main__":
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("".join(json.dumps(row) + "\n" for row in rows()))
    print(f"wrote {ROWS} prompts to {OUT}")
