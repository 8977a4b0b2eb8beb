"""The built-in conversations: a small synthetic set on which a base model trained on
Shakespeare cannot answer and a fine-tuned one can, so that SFT's effect shows as a number.

Usage:
    from data.chat_demo import conversations
    train = conversations(2000, seed=0)   # [{"messages": [...]}, ...]
    held_out = conversations(100, seed=1)

Three kinds, each short enough for the quickstart model's 64 characters:
- a name given in one turn and asked for two turns later ("I am Viola." ... "Who am I?"):
  the answer is in the context, not in the weights;
- a name given by the system message ("Your name is Puck.") and asked for;
- facts about the plays ("Who loves Juliet?" "Romeo."): the answer must be learned.
Every character is one of Shakespeare's, so the char tokenizer of shakespeare_char reads it.
"""

from __future__ import annotations

import random

NAMES = ("Viola", "Puck", "Romeo", "Juliet", "Hamlet", "Portia", "Ariel", "Lear", "Iago",
         "Timon", "Oberon", "Rosalind", "Miranda", "Helena", "Hermia", "Cordelia", "Brutus",
         "Cassius", "Olivia", "Orsino", "Banquo", "Duncan", "Macduff", "Celia", "Touchstone",
         "Caliban", "Prospero", "Lysander", "Bottom", "Falstaff", "Hal", "Antonio", "Bianca",
         "Kate", "Petruchio", "Emilia", "Othello", "Desdemona", "Horatio", "Ophelia")
FACTS = (("Who loves Juliet?", "Romeo."), ("Where is Hamlet prince?", "Denmark."),
         ("Who kills Duncan?", "Macbeth."), ("Whose slave is Caliban?", "Prospero."),
         ("Who is Lear's kind daughter?", "Cordelia."), ("Where is Othello's war?", "Cyprus."),
         ("Who tricks Othello?", "Iago."), ("Who is Hermia's love?", "Lysander."),
         ("Who wears an ass's head?", "Bottom."), ("Who is Portia's husband?", "Bassanio."),
         ("Where do Romeo and Juliet live?", "Verona."), ("Who is Hamlet's friend?", "Horatio."),
         ("Who rules the fairies?", "Oberon."), ("Where is The Tempest set?", "An island."),
         ("Who stabs Caesar first?", "Casca."), ("Who is Ophelia's father?", "Polonius."))


def name_recall(rng: random.Random) -> list[dict]:
    name = rng.choice(NAMES)
    return [{"role": "user", "content": f"I am {name}."},
            {"role": "assistant", "content": f"Hi, {name}."},
            {"role": "user", "content": "Who am I?"},
            {"role": "assistant", "content": f"{name}."}]


def system_name(rng: random.Random) -> list[dict]:
    name = rng.choice(NAMES)
    return [{"role": "system", "content": f"Your name is {name}."},
            {"role": "user", "content": "Who are you?"},
            {"role": "assistant", "content": f"I am {name}."}]


def fact(rng: random.Random) -> list[dict]:
    question, answer = rng.choice(FACTS)
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def conversations(n: int, seed: int = 0) -> list[dict]:
    """n conversations of the three kinds in turn, each drawn from `seed`'s generator."""
    rng = random.Random(seed)
    kinds = (name_recall, system_name, fact)
    return [{"messages": kinds[i % len(kinds)](rng)} for i in range(n)]
