"""The ``wide`` prompt set: many more distinct chat prompts than the ``base`` set.

The base set (``prompts.py``) holds ~3,540 distinct prompts, and every run of ``distill-draft``
with ``--num-prompts 3540`` drew nearly all of them, whatever its ``--seed``: runs 4-7 answered
the same prompts again and again (new samples, the same contexts), which is why more answers
stopped moving the draft. This set crosses more instructions with more topics and adds the
everyday writing tasks people ask a chat model for (emails, recipes, plans, letters, lists,
comparisons), ~20,000 distinct prompts, so a new seed draws mostly new ones.
"""

from __future__ import annotations

import random

EVERYDAY_TOPICS = [
    "houseplants", "a rainy afternoon", "moving to a new city", "learning to swim", "baking cookies",
    "a first job", "saving for a holiday", "raising a puppy", "a kitchen garden", "morning coffee",
    "public transport", "a road trip", "online shopping", "studying for exams", "working from home",
    "a birthday party", "cleaning the house", "a family dinner", "going to the dentist", "winter holidays",
    "summer camp", "a school science fair", "writing a diary", "learning to drive", "a long flight",
    "choosing a laptop", "fixing a bike", "a city park", "a farmers' market", "a museum visit",
    "a thunderstorm", "a snowy day", "a beach holiday", "hiking in the mountains", "a picnic",
    "a wedding", "a new neighbour", "a lost wallet", "a power cut", "a broken phone",
    "a job interview", "a team meeting", "a group project", "a book club", "a music festival",
    "a marathon", "a chess tournament", "a cooking class", "a yoga retreat", "a camping trip",
    "a haunted house", "a treasure hunt", "a talent show", "a school play", "a science museum",
    "the first day of spring", "autumn in the countryside", "a busy train station", "a quiet library",
    "a small bakery", "a fishing village", "a space station", "a desert island", "a city at night",
    "an old lighthouse", "a hot air balloon", "a submarine voyage", "a snowy mountain cabin",
    "a robot helper", "a talking parrot", "a friendly ghost", "a clever fox", "a brave mouse",
    "a lonely giant", "a curious squirrel", "a lazy cat", "a loyal dog", "a wise owl",
    "sunflowers", "strawberries", "pumpkins", "apples", "lemons", "olive oil", "rice", "pasta",
    "potatoes", "carrots", "spinach", "avocados", "bananas", "blueberries", "honey", "cinnamon",
    "green tea", "hot chocolate", "orange juice", "sparkling water", "ice cream", "pancakes",
    "soup", "salad", "sandwiches", "curry", "tacos", "sushi", "dumplings", "bread",
    "spreadsheets", "email etiquette", "passwords", "backups", "keyboard shortcuts", "web browsers",
    "operating systems", "databases", "version control", "unit tests", "recursion", "sorting algorithms",
    "hash tables", "binary search", "regular expressions", "JSON", "HTTP", "command lines",
    "networks", "encryption", "open data", "data visualisation", "statistics", "averages",
    "percentages", "fractions and decimals", "geometry", "algebra", "calculus", "logic puzzles",
    "maps", "compasses", "weather forecasts", "tides", "volcano eruptions", "rock types",
    "the seasons of the year", "the rain cycle", "snowflakes", "thunder", "wind", "fog",
    "forests", "wetlands", "savannas", "the Arctic", "Antarctica", "islands", "caves",
    "whales", "frogs", "ants", "horses", "cows", "chickens", "parrots", "eagles", "bats",
    "crabs", "snails", "bees and flowers", "wildflowers", "oak trees", "cactuses", "moss",
    "kindness", "patience", "courage", "honesty", "curiosity", "teamwork", "gratitude",
    "habits", "goals", "procrastination", "stress", "focus", "motivation", "creativity",
    "listening", "negotiation", "leadership", "feedback", "mentoring", "networking",
    "budget travel", "packing light", "learning an instrument", "drawing", "painting", "pottery",
    "knitting a scarf", "woodworking", "sewing", "calligraphy", "bird watching", "stargazing",
    "running", "cycling", "swimming", "tennis", "football", "basketball", "climbing", "skiing",
]

WIDE_INSTRUCTIONS = [
    "Write a limerick about {t}.",
    "Write a four-line rhyming poem about {t}.",
    "Describe {t} in a few sentences.",
    "Explain {t} in simple words.",
    "Give me three tips about {t}.",
    "Give me five tips for getting started with {t}.",
    "What should everyone know about {t}?",
    "Write a short paragraph about {t} for a school newsletter.",
    "Write a friendly email to a colleague about {t}.",
    "Write a polite message to a neighbour about {t}.",
    "Write a short blog post introduction about {t}.",
    "Write a product description for something related to {t}.",
    "Write a short speech about {t}.",
    "Write a dialogue between two friends talking about {t}.",
    "Tell me a fun fact about {t}.",
    "Tell me a short joke about {t}.",
    "List three surprising things about {t}.",
    "List the main ideas behind {t}.",
    "What questions would a curious child ask about {t}? Answer two of them.",
    "How has {t} changed over the last hundred years?",
    "What would the world be like without {t}?",
    "Write a short story for children about {t}.",
    "Write the opening paragraph of a mystery novel involving {t}.",
    "Summarize what an expert would say about {t}.",
    "Give a step-by-step guide related to {t}.",
    "What are the first three things a beginner should learn about {t}?",
    "Explain {t} using an analogy.",
    "Write a short quiz with three questions about {t}, with answers.",
    "Describe a typical day that involves {t}.",
    "What are some good books or resources for learning about {t}?",
    "Write a motivational quote inspired by {t}.",
    "What is the most interesting thing about {t}? Explain why.",
]

WRITING_TASKS = [
    "Write a polite email asking {w}.",
    "Write a short, friendly text message {w2}.",
    "Draft a formal letter {w2}.",
]

EMAIL_SUBJECTS = [
    "a colleague to join a meeting on Friday", "my landlord to fix the heating",
    "a teacher for more time on an assignment", "a friend to return a borrowed book",
    "my manager for a day off next week", "a shop about a late delivery",
    "a client to confirm an appointment", "a neighbour to keep the noise down at night",
    "a professor for a letter of recommendation", "the team to share their holiday plans",
    "a hotel about an early check-in", "a colleague for feedback on a presentation",
    "a company about a job opening", "the school about a parents' evening",
    "a supplier for a price list", "a friend to help me move house",
]

MESSAGE_PURPOSES = [
    "to thank a friend for a birthday present", "to say I will be late for dinner",
    "to invite a colleague to lunch", "to congratulate a friend on a new job",
    "to apologise for missing a call", "to wish a neighbour a happy new year",
    "to remind my team about tomorrow's deadline", "to cancel a doctor's appointment",
    "to welcome a new team member", "to ask a friend how their exam went",
    "to thank a teacher at the end of the year", "to complain about a noisy party",
]

RECIPE_DISHES = [
    "vegetable soup", "banana bread", "a simple omelette", "lemonade", "fried rice", "pancakes",
    "a green salad", "chocolate chip cookies", "lentil soup", "mashed potatoes", "guacamole",
    "a fruit smoothie", "garlic bread", "tomato pasta", "a vegetable curry", "apple pie",
    "hummus", "roasted vegetables", "a cheese sandwich", "porridge", "scrambled eggs",
    "pizza dough", "a cucumber salad", "iced tea",
]

RECIPE_TEMPLATES = [
    "Give me a recipe for {d}.",
    "How do I make {d}? List the ingredients and the steps.",
    "What can I add to {d} to make it tastier?",
]

LIST_TASKS = [
    "List five healthy snacks for work.", "List five ideas for a rainy day at home.",
    "List five ways to save energy at home.", "List five good habits for students.",
    "List five things to do before a long trip.", "List five hobbies that cost little money.",
    "List five ways to be kinder to the planet.", "List five easy dinners for busy evenings.",
    "List five things to check before buying a used car.", "List five ways to make new friends.",
    "List five questions to ask in a job interview.", "List five tips for a good night's sleep.",
    "List five fun things to do with kids on the weekend.", "List five ways to learn faster.",
    "List five items for a first aid kit.", "List five simple exercises to do at a desk.",
    "Give me ten names for a pet hamster.", "Give me five ideas for a birthday surprise.",
    "Give me five ideas for a short story.", "Give me three ideas for a science project.",
]

PAIRS = [
    ("cats", "dogs"), ("tea", "coffee"), ("trains", "planes"), ("books", "films"),
    ("summer", "winter"), ("cities", "the countryside"), ("Python", "JavaScript"),
    ("running", "swimming"), ("renting", "buying a home"), ("paper books", "e-books"),
    ("a laptop", "a desktop computer"), ("the sun", "the moon"), ("rivers", "lakes"),
    ("frogs", "toads"), ("weather", "climate"), ("viruses", "bacteria"), ("wind power", "solar power"),
    ("a list", "a dictionary in Python"), ("a violin", "a cello"), ("baking", "frying"),
]

PAIR_TEMPLATES = [
    "What is the difference between {a} and {b}?",
    "Compare {a} and {b} in a short table.",
    "Which is better, {a} or {b}? Give reasons for both.",
]

MORE_STORY_STARTERS = [
    "The balloon seller had one balloon left, and it would not stop whispering.",
    "When the power went out, the toys in the attic began to talk.",
    "Grandpa's old radio started playing songs from the future.",
    "A penguin arrived at the zoo with a suitcase.",
    "The snowman was still standing in July.",
    "Every book in the shop had the same last page.",
    "The school bus took a wrong turn into a forest of giant mushrooms.",
    "A tiny robot wanted to learn how to dance.",
    "The moon forgot to rise one night.",
    "A boy found a door in the garden wall that had never been there before.",
    "The fox and the rabbit made an unlikely deal.",
    "On Tuesday, all the clocks in the town ran backwards.",
    "The painter's pictures came to life at night.",
    "A shy dragon opened a bakery.",
    "The pirate ship was crewed entirely by cats.",
    "A little cloud was afraid of heights.",
]

MORE_CODE_TASKS = [
    "counts the words in a sentence", "returns the smallest number in a list", "reverses the words in a sentence",
    "checks whether a year is a leap year", "converts kilometres to miles", "sums the digits of a number",
    "finds the most common letter in a string", "rotates a list by k positions", "checks if a list is sorted",
    "returns the n-th triangular number", "converts a binary string to an integer", "splits a list into chunks",
    "finds all even numbers in a list", "computes the median of a list", "removes vowels from a string",
    "generates a random password", "counts how many times each character appears", "transposes a matrix",
]


def wide_pools(rng: random.Random, topics: list[str], instructions: list[str], story_starters: list[str],
               story_templates: list[str], code_tasks: list[str], code_templates: list[str]) -> list[list[str]]:
    """The wide set's extra categories (each shuffled), given the base set's lists to cross with."""
    all_topics = topics + EVERYDAY_TOPICS
    pools = [
        [i.format(t=t) for t in all_topics for i in instructions + WIDE_INSTRUCTIONS],
        [WRITING_TASKS[0].format(w=w) for w in EMAIL_SUBJECTS]
        + [t.format(w2=w) for w in MESSAGE_PURPOSES for t in WRITING_TASKS[1:]]
        + [t.format(d=d) for d in RECIPE_DISHES for t in RECIPE_TEMPLATES]
        + list(LIST_TASKS)
        + [t.format(a=a, b=b) for a, b in PAIRS for t in PAIR_TEMPLATES],
        [t.format(s=s) for s in story_starters + MORE_STORY_STARTERS for t in story_templates],
        [t.format(c=c) for c in code_tasks + MORE_CODE_TASKS for t in code_templates],
    ]
    for pool in pools:
        rng.shuffle(pool)
    return pools
