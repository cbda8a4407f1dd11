"""Settings for llamaswap: one file, every value read once from the environment."""

import os
from pathlib import Path

import dj_database_url


def envbool(name: str, default: str = "False") -> bool:
    return os.getenv(name, default).strip().lower() in ("1", "true", "yes", "on")


def envint(name: str, default: int) -> int:
    value = os.getenv(name, "").strip()
    return int(value) if value else default


BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = os.getenv("SECRET_KEY", "llamaswap-dev-only-change-me")
DEBUG = envbool("DEBUG")
ALLOWED_HOSTS = [h for h in os.getenv("ALLOWED_HOSTS", "*").split(",") if h]
CSRF_TRUSTED_ORIGINS = [o for o in os.getenv("CSRF_TRUSTED_ORIGINS", "").split(",") if o]

# The llama-swap config.yaml; `manage.py serve --config` overrides it.
LLAMASWAP_CONFIG = os.getenv("LLAMASWAP_CONFIG", "")

# Read-only pages (dashboard, history, request pages) are open unless this is set; the
# admin and anything that changes state always need a login.
DASHBOARD_REQUIRE_LOGIN = envbool("DASHBOARD_REQUIRE_LOGIN")
LOGIN_URL = "/admin/login/"

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "django_prometheus",
    "scheduler",
    "activity",
    "proxy",
    "dashboard",
    "llamaswap_site",  # the composition: `serve` wires the dispatcher, proxy and dashboard
]

# The proxy endpoints bypass this stack (see llamaswap_site/asgi.py): every sync
# middleware costs a thread hop per request under ASGI.
MIDDLEWARE = [
    "django_prometheus.middleware.PrometheusBeforeMiddleware",  # pages only: it is sync
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_prometheus.middleware.PrometheusAfterMiddleware",
]

ROOT_URLCONF = "llamaswap_site.urls"
# A CSRF refusal on an API path answers JSON like every other error there (the 400/403/
# 404/500 handlers are in llamaswap_site/urls.py).
CSRF_FAILURE_VIEW = "proxy.errors.csrf_failure"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

ASGI_APPLICATION = "llamaswap_site.asgi.application"
WSGI_APPLICATION = None

DATABASES = {
    "default": dj_database_url.parse(
        os.getenv("DATABASE_URL", f"sqlite:///{BASE_DIR / 'db.sqlite3'}"),
        conn_max_age=envint("DB_CONN_MAX_AGE", 0),
    )
}

# django-prometheus' wrappers of the stock backends add its django_db_* metrics; SQLite
# runs in WAL mode so the activity log's writes never block readers (dashboard, API).
_PROMETHEUS_ENGINES = {
    "django.db.backends.sqlite3": "django_prometheus.db.backends.sqlite3",
    "django.db.backends.postgresql": "django_prometheus.db.backends.postgresql",
}
_db = DATABASES["default"]
if _db["ENGINE"] == "django.db.backends.sqlite3":
    _db.setdefault("OPTIONS", {}).setdefault(
        "init_command", "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL"
    )
_db["ENGINE"] = _PROMETHEUS_ENGINES.get(_db["ENGINE"], _db["ENGINE"])

# The activity log (activity.recorder): on by default; rows older than the days or
# beyond the newest rows are pruned in the background (and by `manage.py prune_activity`).
ACTIVITY_RECORDING = envbool("ACTIVITY_RECORDING", "true")
ACTIVITY_RETENTION_DAYS = envint("ACTIVITY_RETENTION_DAYS", 30)
ACTIVITY_RETENTION_ROWS = envint("ACTIVITY_RETENTION_ROWS", 100_000)
ACTIVITY_BUFFER_ROWS = envint("ACTIVITY_BUFFER_ROWS", 10_000)
"""Records held in memory while the database is unavailable; beyond it they are dropped."""

REDIS_URL = os.getenv("REDIS_URL", "")
if REDIS_URL:
    CHANNEL_LAYERS = {
        "default": {
            "BACKEND": "channels_redis.core.RedisChannelLayer",
            "CONFIG": {"hosts": [REDIS_URL]},
        }
    }
else:
    CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "/static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
WHITENOISE_USE_FINDERS = True
WHITENOISE_AUTOREFRESH = True

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {
            "()": "llamaswap_site.logfmt.KeyValueFormatter",
            "format": "%(asctime)s %(levelname)s %(name)s %(message)s",
        },
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {
        "llamaswap": {"handlers": ["console"], "level": os.getenv("LOG_LEVEL", "INFO")},
        "django": {"handlers": ["console"], "level": "WARNING"},
    },
}
