"""Settings for llamaswap: one file, every value read once from the environment."""

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import dj_database_url


def envbool(name: str, default: str = "False") -> bool:
    return os.getenv(name, default).strip().lower() in ("1", "true", "yes", "on")


def envint(name: str, default: int) -> int:
    value = os.getenv(name, "").strip()
    return int(value) if value else default


BASE_DIR = Path(__file__).resolve().parent.parent

DEBUG = envbool("DEBUG")
# The names the server answers to (the Host header), checked on every path by the router
# (web/access.py) against DNS rebinding; `*` allows any. Unset: `serve` sets
# the names of its --listen address (loopback: these three, any port).
LOOPBACK_HOSTS = ["localhost", "127.0.0.1", "[::1]"]
ALLOWED_HOSTS = [
    h.strip() for h in os.getenv("ALLOWED_HOSTS", "").split(",") if h.strip()
] or list(LOOPBACK_HOSTS)
CSRF_TRUSTED_ORIGINS = [o for o in os.getenv("CSRF_TRUSTED_ORIGINS", "").split(",") if o]

# The llama-swap config.yaml; `manage.py serve --config` overrides it.
LLAMASWAP_CONFIG = os.getenv("LLAMASWAP_CONFIG", "")

# Read-only pages (dashboard, history, request pages, the websocket, the JSON API) are open
# unless this is set or API keys are configured (dashboard.access.login_required); the
# admin always needs a login.
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
    "control",  # settings records, issued keys, access control and their admin
    "proxy",
    "dashboard",
    "llamaswap_site",  # the composition: `serve` wires the dispatcher, proxy and dashboard
]

# The proxy endpoints bypass this stack (see proxy/handler.py): every sync
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
    "web.dbdown.DatabaseUnavailableMiddleware",  # a 503 saying so, not a 500
    "django_prometheus.middleware.PrometheusAfterMiddleware",
]

ROOT_URLCONF = "llamaswap_site.urls"
# A CSRF refusal on an API path answers JSON like every other error there (the 400/403/
# 404/500 handlers are in llamaswap_site/urls.py).
CSRF_FAILURE_VIEW = "web.errors.csrf_failure"

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
elif _db["ENGINE"] == "django.db.backends.postgresql":
    # A database that goes silent (a cut link, not a refused one) is noticed in seconds,
    # not after the kernel's ~15 min TCP timeout: the activity writer and the pages on this
    # node would wait that long. libpq's own keys; a DATABASE_URL's query string wins.
    _options = _db.setdefault("OPTIONS", {})
    for _key, _value in (
        ("connect_timeout", 5),
        ("keepalives", 1),
        ("keepalives_idle", 10),
        ("keepalives_interval", 5),
        ("keepalives_count", 3),
        ("tcp_user_timeout", 15_000),  # ms: a write no one acknowledges
    ):
        _options.setdefault(_key, _value)
_db["ENGINE"] = _PROMETHEUS_ENGINES.get(_db["ENGINE"], _db["ENGINE"])


def secret_key_file(db: Mapping[str, Any]) -> Path:
    """Where a generated SECRET_KEY is kept: beside the SQLite file (``NAME-secret_key``,
    which the ``*.sqlite3-*`` ignore rule covers), else ``var/secret_key``."""
    name = str(db.get("NAME") or "")
    if db["ENGINE"].endswith("sqlite3") and name and name != ":memory:" and not name.startswith("file:"):
        path = Path(name)
        return path.with_name(path.name + "-secret_key")
    return BASE_DIR / "var" / "secret_key"


def stored_secret_key(path: Path) -> str:
    """The key in ``path``; on the first run a new random one, written with mode 0600
    (atomically: two processes starting together end up with the same key). A folder
    that cannot be written: a key for this process only (sessions end at restart)."""
    import secrets
    import tempfile
    import warnings

    try:
        key = path.read_text().strip()
        if key:
            return key
    except FileNotFoundError:
        pass
    key = secrets.token_urlsafe(50)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".secret_key.")  # mode 0600
        try:
            with os.fdopen(fd, "w") as out:
                out.write(key + "\n")
                out.flush()
                os.fsync(out.fileno())
            try:
                os.link(tmp, path)  # fails if another process was first: use its key
            except FileExistsError:
                return path.read_text().strip() or key
            except OSError:  # a file system without hard links
                os.replace(tmp, path)
                return key
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as exc:
        warnings.warn(
            f"cannot keep a SECRET_KEY in {path} ({exc}): using one for this process only; "
            "set SECRET_KEY",
            stacklevel=1,
        )
    return key


# Given (SECRET_KEY), else generated on the first run and kept beside the database.
SECRET_KEY = os.getenv("SECRET_KEY", "").strip() or stored_secret_key(secret_key_file(_db))

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

# Fleet mode (fleet/, docs/fleet.md): on when REDIS_URL is set and this node has a name
# (`serve --node NAME` overrides LLAMASWAP_NODE). The URL other nodes forward to defaults
# to the listen address; the prefix keeps two fleets on one Redis apart.
LLAMASWAP_NODE = os.getenv("LLAMASWAP_NODE", "").strip()
LLAMASWAP_NODE_URL = os.getenv("LLAMASWAP_NODE_URL", "").strip()
LLAMASWAP_FLEET_PREFIX = os.getenv("LLAMASWAP_FLEET_PREFIX", "").strip() or "llamaswap:fleet"

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
        # Under `serve`, the config's logLevel (or LOG_LEVEL) replaces these levels:
        # llamaswap_site.logfmt.apply_log_config.
        "llamaswap": {"handlers": ["console"], "level": os.getenv("LOG_LEVEL", "INFO")},
        "scheduler": {"handlers": ["console"], "level": os.getenv("LOG_LEVEL", "INFO")},
        "django": {"handlers": ["console"], "level": "WARNING"},
    },
}
