"""Settings of the test Django site. The database and secret come from the environment the
test sets (a fresh SQLite file per test module)."""
import os

SECRET_KEY = os.environ["SFGUARD_DJANGO_SECRET"]
DEBUG = False
ALLOWED_HOSTS = ["admin.test", "127.0.0.1"]
INSTALLED_APPS = ["django.contrib.admin", "django.contrib.auth", "django.contrib.contenttypes",
                  "django.contrib.sessions", "django.contrib.messages"]
MIDDLEWARE = ["django.middleware.security.SecurityMiddleware",
              "django.contrib.sessions.middleware.SessionMiddleware",
              "django.middleware.common.CommonMiddleware",
              "django.middleware.csrf.CsrfViewMiddleware",
              "django.contrib.auth.middleware.AuthenticationMiddleware",
              "django.contrib.messages.middleware.MessageMiddleware"]
ROOT_URLCONF = "tests.django_site.urls"
TEMPLATES = [{"BACKEND": "django.template.backends.django.DjangoTemplates", "APP_DIRS": True,
              "OPTIONS": {"context_processors": ["django.template.context_processors.request",
                                                 "django.contrib.auth.context_processors.auth",
                                                 "django.contrib.messages.context_processors.messages"]}}]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": os.environ["SFGUARD_DJANGO_DB"]}}
USE_TZ = True
STATIC_URL = "/static/"
# as a real HTTPS site: Secure cookies, SameSite=None on the session
SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = True
SESSION_COOKIE_SAMESITE = "None"
SESSION_COOKIE_AGE = 3600
CSRF_TRUSTED_ORIGINS = ["https://admin.test:" + os.environ.get("SFGUARD_DJANGO_PORT", "443")]
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
