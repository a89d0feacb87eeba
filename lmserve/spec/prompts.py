"""The built-in prompt set the learned drafts are trained from (`lmserve train-draft`, `lmserve distill`):
chat-style requests made from request templates and everyday topics, so the target writes its own
answers to a few thousand different requests (what a draft must imitate is the target's text, on
requests like the ones it will serve). Deterministic; none of them is one of the held-out chat prompts
the speculation benchmark measures with (bench/spec.CHAT; tests/test_eagle.py checks it).
"""

from __future__ import annotations

import random

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
