"""Several teachers in one run: which teachers (``spec``), and how their KD terms combine
(``combination``): a weighted sum, or one teacher per sample."""

from megatron_xdistill.teachers.spec import (
    COMBINATIONS,
    TeacherSpec,
    read_teachers_config,
    single_teacher,
    teachers_from_args,
)

__all__ = ["COMBINATIONS", "TeacherSpec", "read_teachers_config", "single_teacher",
           "teachers_from_args"]
