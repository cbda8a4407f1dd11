def test_django_settings_load(settings):
    assert "scheduler" in settings.INSTALLED_APPS
