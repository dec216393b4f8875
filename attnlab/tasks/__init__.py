"""Tasks: one module per task (its data, batch -> loss step and metrics); the trainer
stays generic. A new task is a module with a :class:`Task` subclass and one entry in
``TASKS`` (or :func:`register_task`)."""

from __future__ import annotations

from attnlab.tasks.base import StepOutput, Task, eval_mode, model_extras, shard
from attnlab.tasks.images import ImageClassification
from attnlab.tasks.lm import LanguageModelling
from attnlab.tasks.lm_stream import StreamingLanguageModelling
from attnlab.tasks.mlm import MaskedLanguageModelling
from attnlab.tasks.question_answering import QuestionAnswering
from attnlab.tasks.text_classification import TextClassification
from attnlab.tasks.token_classification import TokenClassification
from attnlab.tasks.translation import NumbersTranslation

TASKS: dict[str, type[Task]] = {
    "lm": LanguageModelling,
    "lm-stream": StreamingLanguageModelling,
    "mlm": MaskedLanguageModelling,
    "seq2seq": NumbersTranslation,
    "image-classification": ImageClassification,
    "text-classification": TextClassification,
    "token-classification": TokenClassification,
    "question-answering": QuestionAnswering,
}


def task_names() -> tuple[str, ...]:
    """The names of the registered tasks."""
    return tuple(TASKS)


def get_task(name: str) -> type[Task]:
    """The task class registered as ``name``; ValueError listing the tasks otherwise."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(TASKS)}") from None


def register_task(cls: type[Task]) -> type[Task]:
    """Class decorator: ``TASKS[cls.name] = cls``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a non-empty ``name`` to be registered")
    TASKS[cls.name] = cls
    return cls


__all__ = [
    "TASKS",
    "ImageClassification",
    "LanguageModelling",
    "MaskedLanguageModelling",
    "NumbersTranslation",
    "QuestionAnswering",
    "StepOutput",
    "StreamingLanguageModelling",
    "Task",
    "TextClassification",
    "TokenClassification",
    "eval_mode",
    "get_task",
    "model_extras",
    "register_task",
    "shard",
    "task_names",
]
