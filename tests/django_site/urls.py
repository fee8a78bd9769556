from pathlib import Path

import django.contrib.admin
from django.contrib import admin
from django.urls import path, re_path
from django.views.static import serve

# the admin's own stylesheets and scripts, as a deployment serves them (DEBUG is off, so Django
# does not serve them by itself)
ADMIN_STATIC = Path(django.contrib.admin.__file__).parent / "static"

urlpatterns = [path("admin/", admin.site.urls),
               re_path(r"^static/(?P<path>.*)$", serve, {"document_root": ADMIN_STATIC})]
