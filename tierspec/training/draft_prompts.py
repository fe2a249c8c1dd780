"""Training prompts for the draft head, built offline and kept apart from every test set.

Sources (docs/algorithms.md §Draft head, issue "trained draft head"): GSM8K *train* questions, WMT14
pairs and CNN/DailyMail articles that Spec-Bench does not use, XSum articles (as summarisation,
question and extraction prompts), and prompts synthesised here from templates: writing, role play,
reasoning puzzles with random numbers, coding tasks, explanations, short factual questions, and
questions about passages (retrieval-style). Never the Spec-Bench or MT-Bench question files and
never HumanEval: the benchmark measures the head on prompts it has not seen.

Each item is a ``TrainingItem``: the user prompt and, where the source has one, a reference
answer (a GSM8K solution, an English translation, a gold summary) that the data builder
teacher-forces through the target as a second kind of text.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path

from ..data import default_data_dir, load_prompts, read_jsonl, summary_prompt


@dataclass(frozen=True)
class TrainingItem:
    source: str  # e.g. "gsm8k-train", "wmt14", "synthetic/coding"
    prompt: str
    reference: str | None = None  # a reference answer to teacher-force, when the source has one


TOPICS = [
    "climate change", "the history of the internet", "black holes", "the Roman Empire", "machine learning",
    "renewable energy", "the human immune system", "the French Revolution", "photosynthesis", "social media",
    "electric cars", "the water cycle", "ancient Egypt", "vaccines", "the stock market", "remote work",
    "the printing press", "volcanoes", "coral reefs", "the Industrial Revolution", "quantum computing",
    "the Olympic Games", "honey bees", "urban gardening", "the Silk Road", "plate tectonics", "jazz music",
    "the Renaissance", "space exploration", "sleep", "coffee", "the Great Wall of China", "cryptography",
    "public libraries", "inflation", "the moon landing", "rainforests", "chess", "the human brain",
    "3D printing", "minimalism", "the Cold War", "recycling", "solar eclipses", "dinosaurs", "friendship",
    "learning a new language", "artificial intelligence in medicine", "the gig economy", "mountain climbing",
    "the history of tea", "meditation", "earthquakes", "video games", "the Amazon river", "democracy",
    "antibiotics", "the invention of the telephone", "wind turbines", "fast fashion", "online privacy",
    "the Mediterranean diet", "castles", "the Moon", "bicycles", "the theory of evolution", "glaciers",
    "public transport", "the Beatles", "time management", "nuclear power", "street food", "robots",
    "the human heart", "deserts", "marathon running", "origami", "supply chains", "the ocean floor",
    "electric guitars", "the history of money", "wolves", "smartphones", "sustainable farming", "Mars",
]

WRITING_FORMS = [
    "a short story", "a poem", "a blog post", "a persuasive essay", "a product description", "a formal email",
    "a short speech", "a limerick", "a dialogue between two friends", "a news article", "a travel guide entry",
    "a letter to the editor", "a haiku", "a movie plot summary", "a motivational message", "a diary entry",
    "a job advertisement", "a restaurant review", "a song chorus", "a children's bedtime story",
]

ROLES = [
    "a pirate captain", "a medieval knight", "Sherlock Holmes", "a travel agent", "a personal fitness coach",
    "a famous chef", "a tour guide in Rome", "a detective in 1920s Chicago", "a friendly librarian",
    "a nervous astronaut", "a wise old wizard", "a customer service agent", "a sports commentator",
    "a history teacher", "a startup founder pitching to investors", "a park ranger", "a time traveller from 2300",
    "a grumpy cat", "a marine biologist", "a stand-up comedian",
]

EXPLAIN_TEMPLATES = [
    "Explain {topic} to a ten-year-old.", "What are the main advantages and disadvantages of {topic}?",
    "Give me three practical tips related to {topic}.", "Write a short introduction to {topic} for beginners.",
    "Compare {topic} and {other}. How are they similar and how are they different?",
    "What are some common misconceptions about {topic}?", "Summarize the key facts about {topic} in five bullet points.",
    "Why is {topic} important today?", "Describe the history of {topic} in a few paragraphs.",
    "What questions would a scientist ask about {topic}?",
]

ROLEPLAY_TEMPLATES = [
    "Pretend you are {role}. Describe your typical day.", "Imagine you are {role}. What do you think about {topic}?",
    "Act as {role} and give advice to someone who is nervous about their first day at a new job.",
    "You are {role}. Write a short message welcoming new visitors.",
    "Role-play as {role} and explain {topic} in your own style.",
]

CODING_TASKS = [
    "reverses a linked list", "checks whether a string is a palindrome", "returns the n-th Fibonacci number",
    "merges two sorted lists into one sorted list", "counts the words in a text file", "finds the largest element of a list",
    "removes duplicates from a list while keeping the order", "implements binary search", "sorts a list with quicksort",
    "checks whether a number is prime", "computes the factorial of a number", "converts Celsius to Fahrenheit",
    "parses a CSV file and returns the rows as dictionaries", "finds the longest common prefix of a list of strings",
    "validates an email address with a regular expression", "flattens a nested list", "computes the mean and median of a list",
    "counts the frequency of each character in a string", "rotates a matrix by 90 degrees", "implements a stack class",
    "implements a queue using two stacks", "finds all anagrams of a word in a list", "computes the greatest common divisor",
    "reads a JSON file and prints its keys", "returns the intersection of two lists", "capitalizes every word of a sentence",
    "checks whether brackets in a string are balanced", "converts a Roman numeral to an integer",
    "finds the second largest number in a list", "implements a simple LRU cache", "computes the sum of the digits of a number",
    "generates all permutations of a string", "finds the maximum subarray sum", "transposes a matrix",
    "checks whether two strings are anagrams", "counts vowels in a string", "returns the prime factors of a number",
    "implements depth-first search on a graph", "implements breadth-first search on a graph", "merges two dictionaries",
]

LANGUAGES = ["Python", "Python", "Python", "JavaScript", "C++", "Java", "Go", "Rust"]

FACT_QUESTIONS = [
    "What is the capital of {country}?", "What language is spoken in {country}?",
    "What is {country} best known for?", "What is the population of {country} roughly?",
]

COUNTRIES = [
    "France", "Japan", "Brazil", "Kenya", "Canada", "Australia", "Germany", "India", "Mexico", "Egypt", "Norway",
    "Argentina", "Vietnam", "Italy", "Spain", "Nigeria", "Peru", "Thailand", "Sweden", "Turkey", "Poland", "Chile",
]

PASSAGE_QUESTIONS = [
    "Who are the people mentioned in the passage, and what did each of them do?",
    "What is the main point of the passage?", "What happened, where, and when, according to the passage?",
    "Which numbers appear in the passage and what do they refer to?", "What might happen next, based on the passage?",
    "List the organisations mentioned in the passage.", "Why does the passage matter to ordinary readers?",
]

EXTRACTION_TEMPLATES = [
    "Extract all names of people and places from the following text and return them as two lists.\n\n{passage}",
    "Return a JSON object with the keys \"who\", \"what\", \"where\" and \"when\" for the following text.\n\n{passage}",
    "Write a headline for the following text.\n\n{passage}",
    "Rewrite the following text in simpler words.\n\n{passage}",
]


def _reasoning_prompt(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 40), rng.randint(2, 40), rng.randint(2, 12)
    templates = [
        f"If {a} people each shake hands with every other person exactly once, how many handshakes are there?",
        f"A train travels {a * 10} km in {c} hours. What is its average speed? Explain your reasoning.",
        f"Tom has {a} apples. He gives {min(a - 1, b)} to his friend and then buys {c} more. How many apples does he have?",
        f"A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
        f"Is {a * b + 1} a prime number? Explain step by step.",
        f"If a shirt costs ${a * 3} and is discounted by {c * 5}%, what is the new price?",
        f"Three friends split a bill of ${a * b} equally and add a {c}% tip. How much does each pay?",
        f"Alice is {a} years old and her brother is {b} years older than half her age. How old is her brother?",
        f"A recipe needs {c} eggs for {b} cookies. How many eggs are needed for {b * c} cookies?",
        f"What is the next number in the sequence {a}, {a + c}, {a + 2 * c}, {a + 3 * c}? Explain.",
        "If all bloops are razzies and all razzies are lazzies, are all bloops lazzies? Explain your reasoning.",
        f"A store sells pencils in packs of {c}. How many packs are needed for {a * b} pencils?",
    ]
    return rng.choice(templates)


def _passage(text: str, rng: random.Random, max_words: int = 180) -> str:
    words = text.split()
    if len(words) <= max_words:
        return text.strip()
    start = rng.randrange(0, max(1, min(len(words) - max_words, 200)))
    return " ".join(words[start : start + max_words])


def _strip_calculator(answer: str) -> str:
    """GSM8K solutions carry calculator annotations (<<48/2=24>>) and a '#### N' line; keep
    the prose a chat model would write."""
    answer = re.sub(r"<<[^>]*>>", "", answer)
    return re.sub(r"\n?#### *(.+)$", r"\nThe final answer is \1.", answer.strip())


def _truncate_words(text: str, max_words: int) -> str:
    words = text.split()
    return text.strip() if len(words) <= max_words else " ".join(words[:max_words])


def training_items(data_dir: Path | None, seed: int = 0) -> tuple[list[TrainingItem], list[TrainingItem]]:
    """(prompts the target answers itself, items whose reference answer is teacher-forced).

    Both lists are shuffled with ``seed``; callers take as many as they need from the front,
    so every prefix is a mix of all sources.
    """
    rng = random.Random(seed)
    gsm8k = load_prompts("gsm8k", data_dir, split="train")
    wmt = [p for p in load_prompts("wmt14", data_dir) if not p.extra.get("in_spec_bench")]
    cnn = [p for p in load_prompts("cnn_dailymail", data_dir) if not p.extra.get("in_spec_bench")]
    xsum = load_prompts("xsum", data_dir)
    root = Path(data_dir) if data_dir else default_data_dir()
    articles = [r["article"] for r in read_jsonl(root / "cnn_dailymail" / "test.jsonl") if not r.get("in_spec_bench")]
    articles += [r["document"] for r in read_jsonl(root / "xsum" / "test.jsonl")]

    own: list[TrainingItem] = []
    own += [TrainingItem("gsm8k-train", p.text) for p in rng.sample(gsm8k, min(700, len(gsm8k)))]
    own += [TrainingItem("wmt14", p.text) for p in rng.sample(wmt, min(500, len(wmt)))]
    for p in cnn:
        own.append(TrainingItem("cnn_dailymail", summary_prompt(_truncate_words(_document_of(p), 320))))
    for r in xsum:
        own.append(TrainingItem("xsum", summary_prompt(_truncate_words(_document_of(r), 320), one_sentence=rng.random() < 0.5)))
    for _ in range(300):
        passage = _passage(rng.choice(articles), rng)
        own.append(TrainingItem("synthetic/rag", f"{passage}\n\nBased on the passage above: {rng.choice(PASSAGE_QUESTIONS)}"))
    for _ in range(120):
        own.append(TrainingItem("synthetic/extraction", rng.choice(EXTRACTION_TEMPLATES).format(passage=_passage(rng.choice(articles), rng, 120))))
    for _ in range(220):
        own.append(TrainingItem("synthetic/writing", f"Write {rng.choice(WRITING_FORMS)} about {rng.choice(TOPICS)}."))
    for _ in range(150):
        own.append(TrainingItem("synthetic/roleplay", rng.choice(ROLEPLAY_TEMPLATES).format(role=rng.choice(ROLES), topic=rng.choice(TOPICS))))
    for _ in range(250):
        topic, other = rng.sample(TOPICS, 2)
        own.append(TrainingItem("synthetic/explain", rng.choice(EXPLAIN_TEMPLATES).format(topic=topic, other=other)))
    for _ in range(200):
        own.append(TrainingItem("synthetic/coding", f"Write a {rng.choice(LANGUAGES)} function that {rng.choice(CODING_TASKS)}."))
    for _ in range(150):
        own.append(TrainingItem("synthetic/reasoning", _reasoning_prompt(rng)))
    for _ in range(120):
        own.append(TrainingItem("synthetic/qa", rng.choice(FACT_QUESTIONS).format(country=rng.choice(COUNTRIES))))
    for name in _entity_names(articles, rng, 150):
        own.append(TrainingItem("synthetic/qa", rng.choice([f"Who or what is {name}?", f"Tell me briefly about {name}."])))
    rng.shuffle(own)

    forced: list[TrainingItem] = []
    forced += [TrainingItem("gsm8k-train-reference", p.text, _strip_calculator(p.reference)) for p in gsm8k if p.reference]
    forced += [TrainingItem("wmt14-reference", p.text, p.reference) for p in wmt if p.reference]
    forced += [TrainingItem("xsum-reference", summary_prompt(_truncate_words(_document_of(r), 320), True), r.reference)
               for r in xsum if r.reference]
    rng.shuffle(forced)
    return own, forced


def _document_of(prompt) -> str:
    """The article of a summarisation prompt (the text after the instruction)."""
    return prompt.text.split("\n\n", 1)[-1]


def _entity_names(texts: list[str], rng: random.Random, count: int) -> list[str]:
    """Capitalised word pairs (names of people, places, organisations) seen in the articles."""
    found = set()
    for text in texts:
        for match in re.finditer(r"\b([A-Z][a-z]{2,}) ([A-Z][a-z]{2,})\b", text):
            found.add(match.group(0))
    names = sorted(n for n in found if not n.split()[0] in {"The", "But", "And", "When", "This", "That", "There", "Mr", "Mrs"})
    return rng.sample(names, min(count, len(names)))
