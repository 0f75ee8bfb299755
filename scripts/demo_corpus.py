"""The demo model's Python text, built from the standard library's own source files.

The files are pinned by name, so the corpus is the same list on every machine; all of
them exist in CPython 3.10 to 3.13. The split is by file: held-out files are never
trained on. The held-out files are byte-identical across CPython 3.10-3.13; the package
ships their text (`lowvram.demo.corpus`), which `python scripts/demo_corpus.py` rewrites.
Training text is read from the local standard library: small differences between versions
there change nothing that is measured.
"""

import sysconfig
from pathlib import Path

from lowvram.demo.corpus import FILE_SEPARATOR, HELDOUT_PATH

HELDOUT_FILES = ("difflib.py", "json/__init__.py", "optparse.py", "pyclbr.py", "tracemalloc.py")

# Codec tables, machine-specific modules and jokes (this.py, antigravity.py) are left out.
TRAINING_FILES = tuple(
    """
    __future__.py _collections_abc.py _compat_pickle.py _compression.py
    _markupbase.py _py_abc.py _pydecimal.py _pyio.py _sitebuiltins.py _strptime.py
    _threading_local.py _weakrefset.py abc.py argparse.py ast.py asyncio/__init__.py
    asyncio/base_events.py asyncio/base_futures.py asyncio/base_subprocess.py
    asyncio/base_tasks.py asyncio/constants.py asyncio/coroutines.py
    asyncio/events.py asyncio/exceptions.py asyncio/format_helpers.py
    asyncio/futures.py asyncio/locks.py asyncio/log.py asyncio/mixins.py
    asyncio/proactor_events.py asyncio/protocols.py asyncio/queues.py
    asyncio/runners.py asyncio/selector_events.py asyncio/sslproto.py
    asyncio/staggered.py asyncio/streams.py asyncio/subprocess.py asyncio/tasks.py
    asyncio/threads.py asyncio/transports.py asyncio/trsock.py
    asyncio/unix_events.py asyncio/windows_events.py asyncio/windows_utils.py
    base64.py bdb.py bisect.py bz2.py cProfile.py calendar.py cmd.py code.py
    codecs.py codeop.py collections/__init__.py collections/abc.py colorsys.py
    compileall.py concurrent/__init__.py concurrent/futures/__init__.py
    concurrent/futures/_base.py concurrent/futures/process.py
    concurrent/futures/thread.py configparser.py contextlib.py contextvars.py
    copy.py copyreg.py csv.py ctypes/__init__.py ctypes/_aix.py ctypes/_endian.py
    ctypes/util.py ctypes/wintypes.py curses/__init__.py curses/ascii.py
    curses/has_key.py curses/panel.py curses/textpad.py dataclasses.py datetime.py
    dbm/__init__.py dbm/dumb.py dbm/gnu.py dbm/ndbm.py decimal.py dis.py doctest.py
    email/__init__.py email/_encoded_words.py email/_header_value_parser.py
    email/_parseaddr.py email/_policybase.py email/base64mime.py email/charset.py
    email/contentmanager.py email/encoders.py email/errors.py email/feedparser.py
    email/generator.py email/header.py email/headerregistry.py email/iterators.py
    email/message.py email/mime/__init__.py email/mime/application.py
    email/mime/audio.py email/mime/base.py email/mime/image.py email/mime/message.py
    email/mime/multipart.py email/mime/nonmultipart.py email/mime/text.py
    email/parser.py email/policy.py email/quoprimime.py email/utils.py enum.py
    filecmp.py fileinput.py fnmatch.py fractions.py ftplib.py functools.py
    genericpath.py getopt.py getpass.py gettext.py glob.py graphlib.py gzip.py
    hashlib.py heapq.py hmac.py html/__init__.py html/parser.py http/__init__.py
    http/client.py http/cookiejar.py http/cookies.py http/server.py imaplib.py
    importlib/__init__.py importlib/_abc.py importlib/_bootstrap.py
    importlib/_bootstrap_external.py importlib/abc.py importlib/machinery.py
    importlib/metadata/__init__.py importlib/metadata/_adapters.py
    importlib/metadata/_collections.py importlib/metadata/_functools.py
    importlib/metadata/_itertools.py importlib/metadata/_meta.py
    importlib/metadata/_text.py importlib/readers.py importlib/util.py inspect.py
    io.py ipaddress.py json/decoder.py json/encoder.py json/scanner.py json/tool.py
    keyword.py linecache.py locale.py logging/__init__.py logging/config.py
    logging/handlers.py lzma.py mailbox.py mimetypes.py modulefinder.py
    multiprocessing/__init__.py multiprocessing/connection.py
    multiprocessing/context.py multiprocessing/dummy/__init__.py
    multiprocessing/dummy/connection.py multiprocessing/forkserver.py
    multiprocessing/heap.py multiprocessing/managers.py multiprocessing/pool.py
    multiprocessing/popen_fork.py multiprocessing/popen_forkserver.py
    multiprocessing/popen_spawn_posix.py multiprocessing/popen_spawn_win32.py
    multiprocessing/process.py multiprocessing/queues.py
    multiprocessing/reduction.py multiprocessing/resource_sharer.py
    multiprocessing/resource_tracker.py multiprocessing/shared_memory.py
    multiprocessing/sharedctypes.py multiprocessing/spawn.py
    multiprocessing/synchronize.py multiprocessing/util.py netrc.py ntpath.py
    nturl2path.py numbers.py opcode.py operator.py os.py pdb.py pickle.py
    pickletools.py pkgutil.py platform.py plistlib.py poplib.py posixpath.py
    pprint.py profile.py pstats.py pty.py py_compile.py pydoc.py queue.py quopri.py
    random.py reprlib.py rlcompleter.py runpy.py sched.py secrets.py selectors.py
    shelve.py shlex.py shutil.py signal.py site.py smtplib.py socket.py
    socketserver.py sqlite3/__init__.py sqlite3/dbapi2.py sqlite3/dump.py
    sre_compile.py sre_constants.py sre_parse.py ssl.py stat.py statistics.py
    string.py struct.py subprocess.py symtable.py tabnanny.py tarfile.py tempfile.py
    textwrap.py threading.py timeit.py token.py tokenize.py trace.py traceback.py
    tty.py turtle.py types.py typing.py unittest/__init__.py unittest/_log.py
    unittest/async_case.py unittest/case.py unittest/loader.py unittest/main.py
    unittest/mock.py unittest/result.py unittest/runner.py unittest/signals.py
    unittest/suite.py unittest/util.py urllib/__init__.py urllib/error.py
    urllib/parse.py urllib/request.py urllib/response.py urllib/robotparser.py
    uuid.py venv/__init__.py warnings.py wave.py weakref.py webbrowser.py
    wsgiref/__init__.py wsgiref/handlers.py wsgiref/headers.py
    wsgiref/simple_server.py wsgiref/util.py wsgiref/validate.py xml/__init__.py
    xml/dom/NodeFilter.py xml/dom/__init__.py xml/dom/domreg.py
    xml/dom/expatbuilder.py xml/dom/minicompat.py xml/dom/minidom.py
    xml/dom/pulldom.py xml/dom/xmlbuilder.py xml/etree/ElementInclude.py
    xml/etree/ElementPath.py xml/etree/ElementTree.py xml/etree/__init__.py
    xml/etree/cElementTree.py xml/parsers/__init__.py xml/parsers/expat.py
    xml/sax/__init__.py xml/sax/_exceptions.py xml/sax/expatreader.py
    xml/sax/handler.py xml/sax/saxutils.py xml/sax/xmlreader.py xmlrpc/__init__.py
    xmlrpc/client.py xmlrpc/server.py zipapp.py zipimport.py zoneinfo/__init__.py
    zoneinfo/_common.py zoneinfo/_tzpath.py zoneinfo/_zoneinfo.py
""".split()
)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _read_files(names: tuple[str, ...]) -> str:
    root = stdlib_dir()
    return FILE_SEPARATOR.join((root / name).read_text(encoding="utf-8") for name in names if (root / name).is_file())


def training_text() -> str:
    """The training files, concatenated in their pinned order (about 7 MB)."""
    text = _read_files(TRAINING_FILES)
    if not text:
        raise FileNotFoundError(f"no standard-library sources under {stdlib_dir()}; training needs them")
    return text


def build_heldout_text() -> str:
    """The held-out files read from this interpreter's standard library."""
    return _read_files(HELDOUT_FILES)


if __name__ == "__main__":
    HELDOUT_PATH.parent.mkdir(parents=True, exist_ok=True)
    HELDOUT_PATH.write_text(build_heldout_text(), encoding="utf-8")
    print(f"wrote {HELDOUT_PATH} ({HELDOUT_PATH.stat().st_size} bytes)")
