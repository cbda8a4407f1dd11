from django.apps import AppConfig


class ControlConfig(AppConfig):
    name = "control"
    verbose_name = "control"

    def ready(self) -> None:
        # Saving or deleting an issued API key reloads the running key ring (signals).
        from control import keys  # noqa: F401
