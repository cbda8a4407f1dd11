"""RequestRecord now belongs to the ``activity`` app. Its table keeps its name
(``scheduler_requestrecord``), so no data moves: the model leaves this app's state here
and enters the activity app's state in ``activity/migrations/0001_initial.py``."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [("scheduler", "0002_outcomes_queue_full_expired")]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.DeleteModel(name="RequestRecord")],
            database_operations=[],
        )
    ]
