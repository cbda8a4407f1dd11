from django.apps import AppConfig


class SchedulerConfig(AppConfig):
    name = "scheduler"

    def ready(self) -> None:
        # Registers the config system checks. Import only: ready() runs for every
        # management command, so nothing may be started here.
        from . import checks  # noqa: F401
