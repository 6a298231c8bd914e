"""A varied, offline prompt set for the target to answer.

The draft only has to imitate the target on the kind of text it will be asked to continue, so
the prompts cover what a chat model gets asked: explanations, lists, how-tos, stories, code,
arithmetic, rewriting, trivia, small talk, and questions about real documentation (the
sections of Python's own ``pydoc_data.topics``, shipped with every Python). Categories are
interleaved, so any prefix of the list -- what a time-limited run gets through -- stays varied.
"""

from __future__ import annotations

import random

from keyserve.training.prompts_wide import wide_pools

TOPICS = [
    "photosynthesis", "black holes", "the French Revolution", "machine learning", "volcanoes",
    "the human heart", "climate change", "the stock market", "honey bees", "the Roman Empire",
    "electric cars", "vaccines", "the internet", "coffee", "the Moon landing", "recycling",
    "sleep", "the water cycle", "chess", "jazz music", "the Great Wall of China", "DNA",
    "renewable energy", "meditation", "ancient Egypt", "earthquakes", "the printing press",
    "rainforests", "time management", "public speaking", "budgeting", "gardening", "dinosaurs",
    "the solar system", "octopuses", "bread baking", "marathon training", "the Olympic Games",
    "cryptography", "antibiotics", "the immune system", "bicycles", "origami", "glaciers",
    "the Renaissance", "quantum computers", "coral reefs", "friendship", "learning a language",
    "job interviews", "healthy eating", "the moon's phases", "lightning", "airplanes",
    "the periodic table", "Shakespeare", "democracy", "inflation", "social media", "robots",
    "the ocean tides", "penguins", "tea", "electricity", "gravity", "the Silk Road", "rainbows",
    "mushrooms", "first aid", "photography", "video games", "the Amazon river", "wolves",
    "3D printing", "the Industrial Revolution", "mountains", "deserts", "volunteering",
    "minimalism", "password security", "composting", "solar panels", "the pyramids", "owls",
    "the violin", "yoga", "cloud computing", "the Eiffel Tower", "camping", "plate tectonics",
]

# Added for the third draft (2026-11-29): the first 1,917 prompts were all answered, and
# held-out agreement was still rising with more answers.
MORE_TOPICS = [
    "the Great Barrier Reef", "submarines", "the Wright brothers", "cheese making", "elephants",
    "the Northern Lights", "hurricanes", "the human brain", "bridges", "paper money",
    "the Cold War", "wind turbines", "spiders", "the Sahara", "chocolate", "the metric system",
    "blood types", "the Mona Lisa", "nuclear power", "rivers", "smartphones", "the Vikings",
    "batteries", "sharks", "the Hubble telescope", "pizza", "the Aztecs", "magnets", "tornadoes",
    "the piano", "linear algebra", "compound interest", "the theory of evolution", "trains",
    "soap", "the ozone layer", "clouds", "the Mayan calendar", "email", "fermentation",
    "open source software", "the Statue of Liberty", "kangaroos", "satellites", "skyscrapers",
    "the Ice Age", "allergies", "chess openings", "the speed of sound", "the Milky Way",
    "butterflies", "the Panama Canal", "probability", "the stock exchange", "dolphins",
    "the Olympic torch", "ancient Greece", "microplastics", "GPS", "bamboo", "the Titanic",
    "sourdough", "tigers", "the human skeleton", "the Internet of Things", "ballet",
    "the Suez Canal", "typography", "rain", "the appendix", "nutrition labels", "jellyfish",
    "the Big Bang", "the Beatles", "fractions", "the library", "water purification", "maple syrup",
    "artificial intelligence ethics", "the Moon", "beavers", "comets", "the lottery", "knitting",
    "the Berlin Wall", "vitamins", "a healthy morning routine", "electric guitars", "sand dunes",
    "the Rosetta Stone", "migration of birds", "the recycling of glass", "street food", "fossils",
    "hydroelectric dams", "the microscope", "the telephone", "the compass", "the Sun",
]

MORE_QUESTIONS = [
    "What is the tallest mountain in the world?", "How many days are in a leap year?",
    "Who painted the Mona Lisa?", "What is the chemical symbol for gold?",
    "How many bones are in the human body?", "What is the longest river in the world?",
    "How do bees make honey?", "What is the difference between a lake and a pond?",
    "Why do we have time zones?", "How does a rainbow form?", "What is a prime number?",
    "How do I make pancakes?", "What is the fastest land animal?", "How do fish breathe?",
    "What is the smallest country in the world?", "Why do we dream?",
    "How do I stay motivated when working from home?", "What is a black hole made of?",
    "How can I save money on groceries?", "What language is spoken in Brazil?",
    "What is the freezing point of water in Fahrenheit?", "How do plants drink water?",
    "What is the difference between a crocodile and an alligator?", "Who invented the light bulb?",
    "How often should I water a cactus?", "What is machine learning in simple terms?",
    "How do I tie a tie?", "What makes a good password?", "Why is the ocean salty?",
    "What is the main ingredient in guacamole?", "How far is the Moon from Earth?",
    "What are the three states of matter?", "How do I write a cover letter?",
    "What is the capital of Japan?", "Why do birds fly south for the winter?",
    "How does the heart pump blood?", "What is a haiku?", "How do I learn to play guitar?",
    "What is the difference between a list and a tuple in Python?", "How do solar panels work?",
]

INSTRUCTIONS = [
    "Explain {t} to a ten-year-old.",
    "What is {t}? Answer in a short paragraph.",
    "Give me three interesting facts about {t}.",
    "Write a short poem about {t}.",
    "What are the pros and cons of {t}?",
    "Summarize the history of {t} in a few sentences.",
    "Write a short story that involves {t}.",
    "List five questions a student might ask about {t}.",
    "How would you explain {t} to someone who has never heard of it?",
    "Write a tweet about {t}.",
    "What are common misconceptions about {t}?",
    "Describe {t} in exactly three sentences.",
    "Why is {t} important?",
    "Write a haiku about {t}.",
    "Give a beginner's guide to {t}.",
    "Compare {t} with something from everyday life.",
]

STORY_STARTERS = [
    "Once upon a time, a small dragon was afraid of fire.",
    "The last train of the night stopped at a station that was not on the map.",
    "Mia found an old key under the floor of her grandmother's house.",
    "The robot woke up in an empty city.",
    "A letter arrived with no stamp and no name.",
    "On the first day of school, Tom's shoes started talking.",
    "The lighthouse keeper saw a light answering from the sea.",
    "Nobody in the village had ever seen snow until that morning.",
    "The cat knew something the family did not.",
    "A young baker wanted to make the biggest cake in the world.",
    "The astronaut heard a knock on the outside of the ship.",
    "Every night at midnight, the library books rearranged themselves.",
    "Two friends got lost in a forest where the trees could move.",
    "The old clock in the hall stopped, and so did time.",
    "A girl found a map drawn on the back of a cereal box.",
    "The king had everything except a single friend.",
    "It rained upwards in the town of Little Hollow.",
    "The new neighbour had a garden that glowed at night.",
    "A fisherman caught a bottle with a message inside.",
    "The museum's dinosaur skeleton was missing one bone.",
]

STORY_TEMPLATES = [
    "Continue this story: {s}",
    "Write a short story that begins with: \"{s}\"",
    "{s} What happens next? Tell the story.",
]

CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "counts the vowels in a word",
    "returns the largest element of a list", "merges two sorted lists", "computes a factorial",
    "removes duplicates from a list", "checks if a word is a palindrome",
    "converts Celsius to Fahrenheit", "finds the average of a list of numbers",
    "reads a text file and counts its lines", "returns the Fibonacci numbers below 100",
    "sorts a list of dictionaries by a key", "flattens a nested list", "counts word frequencies",
    "validates an email address", "computes the greatest common divisor of two numbers",
    "capitalizes every word in a sentence", "checks if two strings are anagrams",
    "finds the second smallest number in a list",
]

CODE_TEMPLATES = [
    "Write a Python function that {c}.",
    "How do I write a program that {c}? Show the code.",
    "Write a JavaScript function that {c}.",
]

PYDOC_TEMPLATES = [
    "Explain the Python topic '{k}' with a short example.",
    "What should a beginner know about '{k}' in Python?",
    "Summarize this part of the Python documentation in plain words:\n\n{snippet}",
]

SENTENCES = [
    "me and him goes to the store yesterday",
    "The meeting has been postponed due to unforeseen circumstances.",
    "i think this product is really good but its too expensive",
    "Please find attached the report you asked for.",
    "The weather was nice so we went to the beach and swam.",
    "Our team finished the project two weeks ahead of schedule.",
    "can u tell me where the train station is",
    "The cat sat on the mat and looked at the dog.",
    "We regret to inform you that your application was not successful.",
    "He runs every morning because it makes him feel alive.",
]

REWRITE_TEMPLATES = [
    "Rewrite this sentence in a formal tone: {s}",
    "Fix the grammar: {s}",
    "Translate into French: {s}",
    "Make this sentence more exciting: {s}",
]

QUESTIONS = [
    "What is the capital of Australia?", "How many legs does a spider have?",
    "Who wrote Romeo and Juliet?", "Why is the sky blue?", "How do airplanes stay in the air?",
    "What is the boiling point of water?", "How many continents are there?",
    "What causes the seasons?", "What is the largest planet in the solar system?",
    "How do I make a cup of tea?", "What is the difference between weather and climate?",
    "How can I improve my sleep?", "What should I pack for a weekend trip?",
    "How do I start learning to code?", "What is a healthy breakfast?",
    "How does a refrigerator work?", "Why do leaves change color in autumn?",
    "What is the speed of light?", "How do I write a good email to my boss?",
    "What are some tips for staying focused while studying?", "What is an API?",
    "How do I change a flat tire?", "What is the difference between a virus and bacteria?",
    "Can you recommend a good book for a long flight?", "How do vaccines work?",
    "What is the Pythagorean theorem?", "How do I cook rice?", "Why do cats purr?",
]

SMALL_TALK = [
    "Hi!", "Hello, how are you?", "What's your name?", "Tell me a joke.", "Good morning!",
    "Can you help me?", "What can you do?", "I'm bored. Any ideas?", "Thank you!",
    "Tell me something interesting.", "What is your favorite color?", "Tell me a fun fact.",
]


# The prompts ``keyserve.training.acceptance`` measures a draft on: never trained on.
HELD_OUT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a CPU cache is.",
    "List three fruits that are red.",
    "How do I reverse a list in Python?",
    "Give me two tips for better sleep.",
    "Why is the sky blue?",
    "Write a short story about a cat who learns to fly.",
    "What are the benefits of regular exercise?",
    "Summarize the plot of Romeo and Juliet in three sentences.",
]

# The prompts ``bench/spec_bench.py`` measures speculative decoding on: kept out of the wide set.
BENCH_PROMPTS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a rainbow forms, in simple words.",
    "Give me three tips for learning a new language.",
    "What is the difference between a list and a tuple in Python?",
    "Write a haiku about autumn leaves.",
    "Describe your ideal weekend in a few sentences.",
    "How do plants make their food?",
    "Summarize the plot of Romeo and Juliet.",
    "Why is the sky blue? Answer for a ten-year-old.",
    "Write a polite email asking a colleague to review my report.",
    "List five healthy breakfast ideas.",
    "What causes the seasons on Earth?",
    "Write a limerick about a cat who loves to swim.",
    "Explain what a function is in programming.",
    "Give me a recipe for a simple tomato soup.",
    "What are the main causes of climate change?",
]


def _pydoc_prompts(rng: random.Random) -> list[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # a trimmed Python without pydoc_data
        return []
    prompts = []
    for key, text in sorted(topics.items()):
        body = " ".join(text.split("\n\n", 2)[1:2]).strip() or text[:400]
        snippet = body[:500]
        template = rng.choice(PYDOC_TEMPLATES)
        prompts.append(template.format(k=key, snippet=snippet))
    return prompts


def _arithmetic(rng: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        op = rng.choice(["plus", "times", "minus"])
        out.append(rng.choice([
            f"What is {a} {op} {b}? Explain step by step.",
            f"If I have {a} apples and buy {b} more, how many do I have?",
            f"A train travels {a} km per hour for {b % 9 + 1} hours. How far does it go?",
        ]))
    return out


def _shared_pools(rng: random.Random, arithmetic: int) -> list[list[str]]:
    """The categories both sets hold as they are (documentation, rewriting, trivia, small talk,
    ``arithmetic`` sums), unshuffled; drawing the pydoc templates and the sums uses ``rng``."""
    return [_pydoc_prompts(rng), [t.format(s=s) for s in SENTENCES for t in REWRITE_TEMPLATES],
            list(QUESTIONS + MORE_QUESTIONS), list(SMALL_TALK), _arithmetic(rng, arithmetic)]


def _pools(rng: random.Random) -> list[list[str]]:
    """Every category's prompts, each shuffled (the ``base`` set: ~3,540 distinct prompts)."""
    pools = [
        [i.format(t=t) for t in TOPICS + MORE_TOPICS for i in INSTRUCTIONS],
        [t.format(s=s) for s in STORY_STARTERS for t in STORY_TEMPLATES],
        [t.format(c=c) for c in CODE_TASKS for t in CODE_TEMPLATES],
        *_shared_pools(rng, 200),
    ]
    for pool in pools:
        rng.shuffle(pool)
    return [p for p in pools if p]


def _wide_pools(rng: random.Random) -> list[list[str]]:
    """The ``wide`` set: the base categories widened (prompts_wide.py), ~20,000 distinct prompts."""
    widened = wide_pools(rng, TOPICS + MORE_TOPICS, INSTRUCTIONS, STORY_STARTERS, STORY_TEMPLATES, CODE_TASKS,
                         CODE_TEMPLATES)  # shuffled there, before the shared pools draw from rng
    shared = _shared_pools(rng, 600)
    for pool in shared:
        rng.shuffle(pool)
    return [p for p in widened + shared if p]


# Draws per round, per category: instructions dominate, the small pools are not exhausted early.
_WEIGHTS = {"base": [6, 2, 2, 2, 1, 1, 1, 1], "wide": [6, 3, 2, 2, 1, 1, 1, 1, 1]}
PROMPT_SETS = tuple(_WEIGHTS)


def build_prompts(n: int, seed: int = 0, prompt_set: str = "base") -> list[str]:
    """``n`` distinct prompts, categories interleaved (deterministic for a seed and set).

    ``base`` is the set draft runs 1-7 drew from, unchanged so their commands replay; it keeps
    out the acceptance tool's prompts only. ``wide`` keeps out the speculative bench's prompts
    too (``bench/spec_bench.py`` measures on them)."""
    if prompt_set not in _WEIGHTS:
        raise ValueError(f"prompt set must be one of {', '.join(PROMPT_SETS)}, not {prompt_set!r}")
    rng = random.Random(seed)
    pools = _pools(rng) if prompt_set == "base" else _wide_pools(rng)
    weights = _WEIGHTS[prompt_set][: len(pools)]
    out: list[str] = []
    never = HELD_OUT_PROMPTS if prompt_set == "base" else HELD_OUT_PROMPTS + BENCH_PROMPTS
    seen: set[str] = set(never)  # never trained on
    while len(out) < n and any(pools):
        for pool, w in zip(pools, weights):
            for _ in range(w):
                if pool and len(out) < n:
                    prompt = pool.pop()
                    if prompt not in seen:
                        seen.add(prompt)
                        out.append(prompt)
    if len(out) < n:
        raise ValueError(f"the prompt set has only {len(out)} distinct prompts; asked for {n}")
    return out


def story_prompts(n: int, seed: int = 0) -> list[str]:
    """Plain story openings, for base models without a chat template (e.g. stories260K)."""
    rng = random.Random(seed)
    names = ["Lily", "Tom", "Ben", "Sue", "Max", "Anna", "Sam", "Mia"]
    things = ["ball", "cat", "tree", "boat", "cake", "dog", "box", "bird"]
    openers = [
        "Once upon a time, there was a little {k} named {n}.",
        "One day, {n} found a big {k}.",
        "{n} and the {k} went to the park.",
        "Once upon a time, {n} had a red {k}.",
    ]
    return [rng.choice(openers).format(n=rng.choice(names), k=rng.choice(things)) for _ in range(n)]
