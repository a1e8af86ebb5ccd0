"""The tutorial's tool (docs/your-agent-task.md): the weather in a city now, as a live service would report it.

The result changes from call to call (it is drawn at random here, as live data would differ), so a model cannot
know it from its training data: it has to call the tool and repeat what the tool said. The results come from a
small closed vocabulary (four words), and so do the cities, which the tiny built-in model can learn to handle.
"""

import random

CITIES = ("Oslo", "Rome", "Lima", "Bern", "Kyiv", "Paris", "Quito", "Dakar")
WEATHERS = ("sunny", "rainy", "cloudy", "windy")


def weather(city: str) -> str:
    """The weather in a city now.

    Args:
        city: the city's name, e.g. "Oslo".
    """
    if city not in CITIES:
        raise ValueError(f"no weather station in {city!r}; the cities are {', '.join(CITIES)}")
    return random.choice(WEATHERS)
