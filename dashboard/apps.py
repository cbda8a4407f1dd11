from django.apps import AppConfig


class DashboardConfig(AppConfig):
    name = "dashboard"

    def ready(self) -> None:
        # Saving or deleting an issued API key reloads the running key ring (signals).
        from dashboard import keys  # noqa: F401
