"""Write moespec/data/chat_calibration.txt: the dense source model's own greedy chat answers.

The default model's calibration text was State of the Union prose only, so no router or refit ever
saw a chat turn. This script asks the dense SmolLM2-135M-Instruct (the GGUF moespec already caches
for the default model) short questions written for moespec (none of them is one of the gates'
FACT_QUESTIONS), renders each exchange with the model's own chat template and writes the
transcripts, separated by blank lines. Greedy decoding in float32: a rerun writes the same file
unless a near-tied next token flips with the CPU kernels' last-bit differences; the file is
vendored, so builds never depend on a rerun.

Usage: python scripts/make_chat_calibration.py   (needs the cached source: moespec download --default)
"""

from __future__ import annotations

from pathlib import Path

import torch
from rich.console import Console
from transformers import AutoModelForCausalLM, AutoTokenizer

from moespec.default_model import source
from moespec.fsutil import atomic_write_text

QUESTIONS = [
    # capitals and geography (not France or Japan: those are gate questions)
    "What is the capital of Italy?", "What is the capital of Germany?", "What is the capital of Spain?",
    "What is the capital of Canada?", "What is the capital of Egypt?", "What is the capital of Brazil?",
    "What is the capital of Kenya?", "What is the capital of Australia?", "What is the capital of India?",
    "What is the capital of Mexico?", "Which river flows through London?", "What is the largest ocean on Earth?",
    "On which continent is Argentina?", "What is the highest mountain in the world?",
    "Which country has the largest population?", "What is the longest river in Africa?",
    # arithmetic (not 2+2)
    "What is 3+5?", "What is 7+6?", "What is 10-4?", "What is 9-3?", "What is 3 times 4?", "What is 6*7?",
    "What is 12 divided by 3?", "What is 15+27?", "What is 100-58?", "What is half of 50?",
    "What is 5 squared?", "What is 1+1?", "What is 8+9?", "How many days are in a week?",
    "How many minutes are in an hour?", "How many legs does a spider have?",
    # science and everyday facts
    "What color is the sky on a clear day?", "What is the chemical symbol for water?",
    "What gas do plants absorb from the air?", "What is the boiling point of water in Celsius?",
    "How many planets are in the solar system?", "What is the largest planet in the solar system?",
    "What is the closest star to Earth?", "What do bees make?", "What is the freezing point of water?",
    "Why do we have seasons?", "What is photosynthesis?", "What is gravity?", "What is an atom?",
    "How does a rainbow form?", "What is the speed of light?", "What organ pumps blood through the body?",
    # language, history, definitions
    "Who wrote Romeo and Juliet?", "Who painted the Mona Lisa?", "Who was the first president of the United States?",
    "In which year did World War II end?", "What is a noun?", "What is the opposite of hot?",
    "What is a synonym for happy?", "Translate 'thank you' into Spanish.", "What language is spoken in Brazil?",
    "What is democracy?", "What is the plural of mouse?", "Spell the word 'necessary'.",
    # short tasks and advice
    "Give me a tip for sleeping better.", "Write a short sentence about the ocean.",
    "Name three fruits.", "Name three colors.", "How do I make a cup of tea?", "Tell me a fun fact about cats.",
    "What should I pack for a trip to the beach?", "Suggest a name for a pet dog.",
    "How can I stay healthy?", "Write a haiku about autumn.", "Explain what a computer is in one sentence.",
    "What is the best way to learn a new language?", "Hi! How are you today?", "Can you help me plan my day?",
]


@torch.no_grad()
def transcripts(model, tokenizer, questions: list[str], max_new_tokens: int = 64, batch: int = 24) -> list[str]:
    """Each question and the model's greedy answer, rendered with the chat template."""
    tokenizer.padding_side = "left"
    out = []
    for start in range(0, len(questions), batch):
        chats = [[{"role": "user", "content": q}] for q in questions[start:start + batch]]
        enc = tokenizer.apply_chat_template(chats, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True, padding=True)
        ids = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
        for chat, row in zip(chats, ids[:, enc["input_ids"].shape[1]:]):
            answer = tokenizer.decode(row, skip_special_tokens=True).strip()
            out.append(tokenizer.apply_chat_template(chat + [{"role": "assistant", "content": answer}], tokenize=False))
    return out


def main() -> None:
    gguf = source.ensure_gguf(Console(stderr=True))
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    path = Path(__file__).resolve().parents[1] / "moespec" / "data" / "chat_calibration.txt"
    atomic_write_text(path, "\n\n".join(transcripts(model, tokenizer, QUESTIONS)) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
