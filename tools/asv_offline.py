"""Make an ``asv publish`` dashboard work without a network: vendor the JavaScript and CSS it loads from CDNs
(jQuery, flot and its plugins, stupidtable, blueimp-md5, Bootstrap 3) next to the HTML and point the page at them.

    python tools/asv_offline.py .asv/html                  # after `asv publish`; `make dashboard` runs both
    python tools/asv_offline.py --fetch-only               # fill the tarball cache on a machine that has npm

asv ships its own scripts (asv.js, graphdisplay.js, jquery.flot.axislabels.js, ...) in its www/ directory, but
``index.html`` loads ten third-party files from code.jquery.com, cdnjs and jsDelivr; offline, the first one fails
and the page redirects to asv's "Can not determine continental origin of swallow" error. Each of those files comes
here from the npm package of the same library (``npm pack``, which checks the registry's integrity hash), at the
version asv pins: the same bytes for the files jsDelivr serves straight from npm (jQuery, Bootstrap, orderBars,
md5), and the unminified npm sources of flot 0.8.3 for cdnjs's minified copies. stupidtable 1.0.1 was never
published to npm: its successor 1.1.3, the same one-function jQuery plugin, stands in. The files go to
``vendor/<package>-<version>/`` beside ``index.html``, keeping each package's layout so Bootstrap's CSS finds its
fonts, and the tags lose their ``integrity``/``crossorigin`` attributes, which describe the CDN copies.

Tarballs are cached (default ``.asv/npm-cache``), so the step runs offline once they are there: fetch them where
the npm registry is reachable and copy the cache (or the finished HTML) to the offline machine. A CDN address this
table does not know (a newer asv) stops the step with the address, rather than leave a page that cannot load.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CACHE = REPO / ".asv" / "npm-cache"


@dataclass(frozen=True)
class Asset:
    """One CDN file of asv's index.html: the address's tail, the npm package that holds it and the file inside."""

    url_tail: str
    package: str      # name@version
    path: str         # inside the package
    also: tuple[str, ...] = ()   # directories of the package the file refers to (Bootstrap's fonts)

    @property
    def dirname(self) -> str:
        return self.package.replace("@", "-")


ASSETS = (
    Asset("/jquery-3.3.1.min.js", "jquery@3.3.1", "dist/jquery.min.js"),
    Asset("/flot/0.8.3/jquery.flot.min.js", "flot@0.8.3", "jquery.flot.js"),
    Asset("/flot/0.8.3/jquery.flot.time.min.js", "flot@0.8.3", "jquery.flot.time.js"),
    Asset("/flot/0.8.3/jquery.flot.selection.min.js", "flot@0.8.3", "jquery.flot.selection.js"),
    Asset("/flot/0.8.3/jquery.flot.categories.min.js", "flot@0.8.3", "jquery.flot.categories.js"),
    Asset("/flot-orderbars@1.0.0/js/jquery.flot.orderBars.js", "flot-orderbars@1.0.0", "js/jquery.flot.orderBars.js"),
    Asset("/stupidtable/1.0.1/stupidtable.min.js", "stupid-table-plugin@1.1.3", "stupidtable.min.js"),
    Asset("/blueimp-md5/2.19.0/js/md5.min.js", "blueimp-md5@2.19.0", "js/md5.min.js"),
    Asset("/bootstrap@3.1.1/dist/js/bootstrap.min.js", "bootstrap@3.1.1", "dist/js/bootstrap.min.js"),
    Asset("/bootstrap@3.1.1/dist/css/bootstrap.min.css", "bootstrap@3.1.1", "dist/css/bootstrap.min.css",
          also=("dist/fonts",)),
)

# A <script src=...> or <link href=...> tag that loads from an absolute http(s) address.
TAG = re.compile(r"<(script|link)\b[^>]*?\b(src|href)=\"(https?://[^\"]+)\"[^>]*>", re.IGNORECASE)
DROP_ATTRS = re.compile(r"\s+(integrity|crossorigin|referrerpolicy)=\"[^\"]*\"", re.IGNORECASE)


class OfflineError(RuntimeError):
    """The page cannot be made offline-ready; the message says what to do."""


def tarball(package: str, cache: Path) -> Path:
    """The npm tarball of ``package`` (name@version) from ``cache``, fetched with ``npm pack`` if missing."""
    name, version = package.rsplit("@", 1)
    path = cache / f"{name}-{version}.tgz"
    if path.is_file():
        return path
    npm = shutil.which("npm")
    if npm is None:
        raise OfflineError(f"{path} is not cached and npm is not installed: run `python tools/asv_offline.py "
                           f"--fetch-only` where npm reaches its registry, then copy {cache} here")
    cache.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([npm, "pack", "--silent", "--pack-destination", str(cache), package],
                          capture_output=True, text=True)
    if proc.returncode != 0 or not path.is_file():
        raise OfflineError(f"npm pack {package} failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    return path


def _extract(archive: Path, inner: str, dest: Path) -> list[Path]:
    """Files of ``archive`` under ``package/<inner>`` (a file or a directory) copied below ``dest``."""
    written = []
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            rel = member.name.split("/", 1)[1] if "/" in member.name else member.name
            if not member.isfile() or not (rel == inner or rel.startswith(inner.rstrip("/") + "/")):
                continue
            if ".." in Path(rel).parts:
                raise OfflineError(f"{archive}: unsafe path {member.name}")
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(member) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)
            written.append(target)
    if not written:
        raise OfflineError(f"{archive} has no {inner}")
    return written


def _sri(data: bytes, algorithm: str) -> str:
    return f"{algorithm}-" + base64.b64encode(hashlib.new(algorithm, data).digest()).decode()


def asset_for(url: str) -> Asset:
    """The table's entry for a CDN address; OfflineError for one it does not know."""
    for asset in ASSETS:
        if url.endswith(asset.url_tail):
            return asset
    raise OfflineError(f"index.html loads {url}, which tools/asv_offline.py does not know (a newer asv?): add it "
                       f"to ASSETS with the npm package that ships it")


def make_offline(html_dir: Path, cache: Path = DEFAULT_CACHE) -> list[str]:
    """Vendor every CDN file ``html_dir/index.html`` loads, inline its JSON (``inline_data``) and rewrite the page;
    returns one line per vendored file, then the inlining's. Idempotent: a page already rewritten has nothing left
    to vendor, and its JSON is inlined afresh."""
    index = html_dir / "index.html"
    if not index.is_file():
        raise OfflineError(f"{index} not found: run `asv publish` first")
    text = index.read_text()
    report = []

    def replace(match: re.Match) -> str:
        attr, url = match.group(2), match.group(3)
        asset = asset_for(url)
        base = html_dir / "vendor" / asset.dirname
        archive = tarball(asset.package, cache)
        (file,) = _extract(archive, asset.path, base)
        for extra in asset.also:
            _extract(archive, extra, base)
        integrity = re.search(r'integrity="(sha\d+)-[^"]*"', match.group(0))
        same = integrity is not None and _sri(file.read_bytes(), integrity.group(1)) in match.group(0)
        report.append(f"{url} -> vendor/{asset.dirname}/{asset.path} ({asset.package}"
                      + (", byte-identical: its integrity hash matches)" if same else ")"))
        local = f"vendor/{asset.dirname}/{asset.path}"
        return DROP_ATTRS.sub("", match.group(0).replace(f'{attr}="{url}"', f'{attr}="{local}"'))

    new = TAG.sub(replace, text)
    report.append(inline_data(html_dir))
    if OFFLINE_TAG not in new:
        jquery = re.search(r"<script\b[^>]*src=\"vendor/jquery-[^\"]*\"[^>]*></script>", new)
        if jquery is None:
            raise OfflineError(f"{index}: no vendored jQuery tag to load {OFFLINE_JS} after")
        new = new[:jquery.end()] + "\n    " + OFFLINE_TAG + new[jquery.end():]
    if new != text:
        index.write_text(new)
    return report


# The page fetches its JSON (info.json, index.json, graphs/...) with jQuery's ajax, which a browser refuses for a
# page opened from disk (file://), so a double-clicked index.html showed only "Error fetching content". The JSON
# files go into one script, and a jQuery transport answers the page's requests from it; a file it lacks still goes
# to the network, so a served page behaves as before.
OFFLINE_JS = "asv_offline_data.js"
OFFLINE_TAG = f'<script src="{OFFLINE_JS}"></script>'
TRANSPORT = """
(function ($) {
  var files = window.ASV_OFFLINE_FILES;
  $.ajaxTransport("+*", function (options) {
    var name = options.url.split("?")[0].split("#")[0];
    if (!Object.prototype.hasOwnProperty.call(files, name)) return;
    return {
      send: function (headers, complete) {
        var body = files[name];
        setTimeout(function () {
          complete(200, "OK", typeof body === "string" ? {text: body} : {json: body});
        }, 0);
      },
      abort: function () {}
    };
  });
})(jQuery);
"""


def inline_data(html_dir: Path) -> str:
    """Write ``asv_offline_data.js``: every JSON file of the published page (vendor/ aside) and the transport that
    serves them. Rewritten on each call, so that it follows a new ``asv publish``."""
    files: dict[str, object] = {"swallow.ico": ""}   # the page's "is the server up?" probe, a text request
    for path in sorted(html_dir.rglob("*.json")):
        rel = path.relative_to(html_dir).as_posix()
        if not rel.startswith("vendor/"):
            files[rel] = json.loads(path.read_text())
    data = json.dumps(files, separators=(",", ":"))
    (html_dir / OFFLINE_JS).write_text(f"window.ASV_OFFLINE_FILES = {data};\n{TRANSPORT}")
    return f"{len(files) - 1} JSON file(s) -> {OFFLINE_JS} (the page opens from disk, file://, too)"


def fetch_all(cache: Path = DEFAULT_CACHE) -> list[Path]:
    """Every tarball the table needs, in ``cache``."""
    return [tarball(p, cache) for p in dict.fromkeys(a.package for a in ASSETS)]


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status (1 when the page cannot be made offline-ready)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("html_dir", nargs="?", default=str(REPO / ".asv" / "html"), help="asv's html_dir")
    p.add_argument("--cache", default=str(DEFAULT_CACHE), help="where the npm tarballs are kept")
    p.add_argument("--fetch-only", action="store_true", help="fill the cache and stop")
    args = p.parse_args(argv)
    try:
        if args.fetch_only:
            for path in fetch_all(Path(args.cache)):
                print(f"cached {path}")
            return 0
        lines = make_offline(Path(args.html_dir), Path(args.cache))
    except OfflineError as exc:
        print(f"asv_offline: error: {exc}", file=sys.stderr)
        return 1
    for line in lines:
        print(line)
    vendored = len(lines) - 1
    print(f"{args.html_dir}: {vendored} file(s) vendored; the dashboard needs no network"
          if vendored else f"{args.html_dir}: nothing loads from a CDN any more")
    print(f"open {(Path(args.html_dir) / 'index.html').resolve().as_uri()} in a browser (or serve it: asv preview)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
