"""The built-in prompt set the learned drafts are trained from (`lmserve train-draft`, `lmserve distill`):
chat-style requests made from request templates and everyday topics, so the target writes its own
answers to a few thousand different requests (what a draft must imitate is the target's text, on
requests like the ones it will serve). Deterministic; none of them is one of the held-out chat prompts
the speculation benchmark measures with (CHAT, below; tests/test_eagle.py checks it).
"""

from __future__ import annotations

import random
import re

# chat-style prompts held out from training: the speculation benchmark's (bench/spec.py); no training
# request is one of them (cli/train_draft.PROMPTS, builtin_prompts, self_prompts)
CHAT = [
    "What are the main differences between a lake and a river?", "Write a short story about a robot learning to paint.",
    "How can I improve my handwriting?", "Explain how a solar panel turns light into electricity.",
    "Give me five ideas for a birthday party for a ten-year-old.", "Why do leaves change colour in autumn?",
    "Describe the life of a honey bee.", "What is a good way to start running if I have never exercised?",
    "Write a letter to a neighbour about a noisy dog.", "How does a library organise its books?",
    "What should I know before adopting a cat?", "Explain what an atom is to a child.",
    "Write a short poem about winter mornings.", "How do trains stay on their tracks?",
    "What are some healthy breakfast ideas?", "Tell me about the history of the bicycle.",
]
# their subjects: no training request names one
CHAT_SUBJECTS = ("lake", "river", "robot", "handwriting", "solar panel", "birthday", "leaves", "honey", "bee",
                 "running", "dog", "library", "cat", "atom", "winter", "train", "breakfast", "bicycle")

TEMPLATES = [
    "Explain {t} in simple terms.", "What are the most important things to know about {t}?",
    "Write a short story that involves {t}.", "Give me three practical tips about {t}.",
    "What are the pros and cons of {t}?", "Describe {t} to someone who has never heard of it.",
    "Write a short poem about {t}.", "What is the history of {t}?", "How would you teach a child about {t}?",
    "List five interesting facts about {t}.", "Write a friendly email to a colleague about {t}.",
    "What are common mistakes people make with {t}?", "Summarize the main ideas behind {t}.",
    "Write a dialogue between two friends discussing {t}.", "Why do people care about {t}?",
    "How has {t} changed in the last hundred years?", "Give a step-by-step guide to getting started with {t}.",
    "What questions should I ask an expert about {t}?", "Write a product description related to {t}.",
    "Compare {t} with something similar and explain the differences.",
    "What would a beginner find surprising about {t}?", "Write a short speech about {t}.",
    "What are some myths about {t}, and what is the truth?", "Plan a one-day workshop about {t}.",
    "Write a diary entry from someone who just discovered {t}.", "How does {t} affect everyday life?",
    "What careers are connected to {t}?", "Write a riddle whose answer is {t}.",
    "Give me a short quiz with answers about {t}.", "What is the future of {t}?",
]

TOPICS = [
    "gardening", "the moon", "volcanoes", "saving money", "chess", "the human heart", "electric cars",
    "rain forests", "baking bread", "the printing press", "friendship", "recycling", "photography",
    "the ocean tides", "learning to swim", "coffee", "bridges", "penguins", "time management",
    "the Olympic Games", "maps", "music lessons", "earthquakes", "the post office", "wind energy",
    "knitting", "dinosaurs", "city parks", "telescopes", "camping", "the immune system", "board games",
    "deserts", "writing a resume", "lighthouses", "birds migrating", "clocks", "the alphabet", "yoga",
    "electricity", "fairy tales", "tea", "glaciers", "first aid", "museums", "computers", "soap",
    "the weather forecast", "owls", "teamwork", "mountains", "vitamins", "airports", "the internet",
    "kindness", "spiders", "pizza", "the solar system", "basketball", "islands", "languages", "farming",
    "castles", "rainbows", "cooking rice", "hospitals", "newspapers", "the desert fox", "public speaking",
    "whales", "kites", "cheese", "fire safety", "the Roman Empire", "the brain", "podcasts", "magnets",
    "ants", "jazz", "sleep", "coral reefs", "shoes", "vaccines", "volunteering", "forests", "elevators",
    "the calendar", "ice cream", "mathematics", "submarines", "tigers", "online shopping", "umbrellas",
    "the stock market", "dancing", "potatoes", "hurricanes", "a small business", "fossils",
    "the microwave oven", "zoos", "wool", "batteries", "the violin", "moving to a new city", "apples",
    "satellites", "the pyramids", "composting", "horses", "puzzles", "the immune response to colds",
    "plastic", "thunderstorms", "pottery", "smartphones", "origami", "fishing", "the human skeleton",
    "carpentry", "sunscreen", "olive oil", "wolves",
]


def builtin_prompts() -> list[str]:
    """Every template with every topic, in a fixed shuffled order (3,690 prompts)."""
    prompts = [t.format(t=topic) for topic in TOPICS for t in TEMPLATES]
    random.Random(0).shuffle(prompts)
    return prompts


# Requests for requests: the target writes user requests itself (sampled), for variety the templates
# lack (their answers alone taught the head a narrow style: BENCHMARKS.md, the thirteenth session).
ASKS = [
    "Write one question a curious person might ask an AI assistant. Reply with the question only.",
    "Give me an example of a request someone could send to a helpful assistant. Reply with the request only.",
    "Ask me an interesting question about everyday life.",
    "Write a single instruction for a writing task. Reply with the instruction only.",
    "What is something a student might ask a teacher? Reply with the question only.",
    "Write a request for advice that someone might send to a friend. Reply with the request only.",
    "Ask a question about science that a child might ask.",
    "Write a task you would give to an assistant about {t}. Reply with the task only.",
    "Ask a question about {t}. Reply with the question only.",
]


def names_a_held_out_subject(text: str) -> bool:
    """text names a subject of the benchmark's held-out chat prompts (CHAT_SUBJECTS; whole
    words, a plural s allowed)."""
    return any(re.search(rf"\b{w}s?\b", text, re.IGNORECASE) for w in CHAT_SUBJECTS)


# endings of words that are rarely things (participles, adverbs, adjectives): not topics
_NOT_A_THING = re.compile(r"(ed|ly|ing|ous|ive|al|ful|able|less)$")


def vocabulary_topics(tokens: list[str]) -> list[str]:
    """Topics for many more subjects than TOPICS' 128, read from a tokenizer's own vocabulary (`tokens`:
    its token strings by id): whole lowercase words of 5-12 letters (a token that starts a word: the
    byte-level "Ġ" or sentencepiece's "▁") whose plural is a token too (mostly nouns; verbs pass as well),
    none with a participle / adverb / adjective ending, none a held-out subject. In id order, distinct.
    (Measured in the fourteenth session, BENCHMARKS.md: 2,451 subjects moved the head's first-draft
    acceptance on the held-out chat prompts by one point.)"""
    whole = {t[1:] for t in tokens if isinstance(t, str) and t[:1] in ("Ġ", "▁")}
    out, seen = [], set()
    for t in tokens:
        if not isinstance(t, str) or t[:1] not in ("Ġ", "▁"):
            continue
        w = t[1:]
        if (re.fullmatch(r"[a-z]{5,12}", w) and w + "s" in whole and not _NOT_A_THING.search(w)
                and not names_a_held_out_subject(w) and w not in seen):
            seen.add(w)
            out.append(w)
    return out


def topic_prompts(topics: list[str], per_topic: int, seed: int = 0) -> list[str]:
    """per_topic requests for each topic, each from a different template (TEMPLATES, a seeded choice per
    topic), in a seeded shuffled order."""
    if not 1 <= per_topic <= len(TEMPLATES):
        raise ValueError(f"per_topic: must be in 1..{len(TEMPLATES)}, got {per_topic}")
    rng = random.Random(seed)
    prompts = [t.format(t=topic) for topic in topics for t in rng.sample(TEMPLATES, per_topic)]
    rng.shuffle(prompts)
    return prompts
