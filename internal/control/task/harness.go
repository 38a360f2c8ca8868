package task

import (
	"fmt"
	"regexp"
	"strings"
)

// HarnessSpec is how SWE-bench's evaluation harness runs an instance's tests.
type HarnessSpec struct {
	TestCmd string   // the whole shell command, run with /bin/sh -c in the work tree /work
	Parser  string   // a key of task.Parsers
	Files   []string // the test directives derived from test_patch, in the harness's order
}

// HarnessTest says how SWE-bench's evaluation harness tests an instance of
// repo (OWNER/NAME) at version (the instance's "version" field): the test
// command with the directives it derives from testPatch, and the parser it
// reads the output with.
//
// The facts come from SWE-bench's harness (github.com/SWE-bench/SWE-bench):
// its per-repository, per-version table of test commands and its
// derivation of test directives as SWE-bench 4 has them (the same from
// 4.0.1 to 4.1.0; 5.0 moved the eval scripts into the datasets), and its
// log parsers, repository → parser map and grading rules as of 5.0.2.
// The commands are translated where the harness's would not run in a plain
// shell in /work (see harnessRepos); the directives are shell-quoted where
// they need it. A repository the table does not know gets the harness's
// plain pytest -rA and the pytest parser; a version it does not know gets
// the repository's usual command.
//
// The directives are what the harness derives, quirks included: every
// `diff --git a/X b/Y` header in the patch gives Y (a deleted file too, and
// a header inside the patch's text counts), in order, duplicates kept;
// files with a fixture's ending are dropped (see nonTestSuffixes); for
// Django, tests/a/b.py becomes the test label a.b. With nothing left to run
// HarnessTest fails (the harness would run the whole suite).
func HarnessTest(repo, version, testPatch string) (HarnessSpec, error) {
	headers := diffHeaderRE.FindAllStringSubmatch(testPatch, -1)
	if len(headers) == 0 {
		return HarnessSpec{}, fmt.Errorf("%s: the test patch has no \"diff --git a/... b/...\" header: there are no test files to run", repo)
	}
	var files, dropped []string
	for _, h := range headers {
		// The harness keeps a CRLF patch's \r in the name (and then no
		// file has it); we drop it.
		f := strings.TrimSuffix(h[1], "\r")
		if isFixture(f) {
			dropped = append(dropped, f)
			continue
		}
		if repo == "django/django" {
			f = djangoLabel(f)
		}
		files = append(files, f)
	}
	if len(files) == 0 {
		return HarnessSpec{}, fmt.Errorf("%s: the test patch changes no test files, only fixtures (%s): SWE-bench's harness drops files ending in %s, and would run the whole suite",
			repo, strings.Join(dropped, ", "), strings.Join(nonTestSuffixes, " "))
	}
	r, ok := harnessRepos[repo]
	if !ok {
		r = harnessDefault
	}
	cmd := r.cmd
	if c, ok := r.byVersion[version]; ok {
		cmd = c
	}
	quoted := make([]string, len(files))
	for i, f := range files {
		quoted[i] = shellQuote(f)
	}
	return HarnessSpec{TestCmd: cmd + " " + strings.Join(quoted, " "), Parser: r.parser, Files: files}, nil
}

// diffHeaderRE finds a test patch's files as the harness does: anywhere in
// a line (not only at its start), and greedily, so that the name is what
// follows the line's last " b/".
var diffHeaderRE = regexp.MustCompile(`diff --git a/.* b/(.*)`)

// nonTestSuffixes are the endings of the files the harness does not run.
// "csv" has no dot in the harness's list, so a name that merely ends in
// csv is dropped too; the match is case-sensitive.
var nonTestSuffixes = []string{".json", ".png", "csv", ".txt", ".md", ".jpg", ".jpeg", ".pkl", ".yml", ".yaml", ".toml"}

func isFixture(f string) bool {
	for _, s := range nonTestSuffixes {
		if strings.HasSuffix(f, s) {
			return true
		}
	}
	return false
}

// djangoLabel turns tests/a/b.py into the runtests.py label a.b (a file
// that does not end in .py keeps its ending, as in the harness).
func djangoLabel(f string) string {
	f = strings.TrimSuffix(f, ".py")
	f = strings.TrimPrefix(f, "tests/")
	return strings.ReplaceAll(f, "/", ".")
}

// shellQuote quotes s for /bin/sh if it needs it.
func shellQuote(s string) string {
	if s != "" && strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_./:=+,@%-") == "" {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// harnessRepo is one repository's row of the table: the test command (the
// directives follow it), per-version exceptions, and the parser.
type harnessRepo struct {
	cmd       string
	byVersion map[string]string
	parser    string
}

// harnessDefault is for a repository the table does not know.
var harnessDefault = harnessRepo{cmd: hPytest, parser: "pytest"}

// The harness's test commands. Where they start with pytest they stay so:
// the environment puts the right pytest on PATH.
const (
	hPytest  = "pytest -rA"
	hSeaborn = "pytest --no-header -rA"
	// astropy 0.1–1.3 (pytest 3.3): verbose lines as well as the summary.
	hAstropyOld = "pytest -rA -vv -o console_output_style=classic --tb=no"

	// The harness runs ./tests/runtests.py and bin/test through their
	// "#!/usr/bin/env python" lines, which need an executable bit and a
	// python on PATH; python3 runs the same script with the same output.
	hDjango       = "python3 tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1"
	hDjangoSerial = "python3 tests/runtests.py --verbosity 2" // 1.9
	hSympy        = "PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' python3 bin/test -C --verbose"

	// Django 1.7–2.2 and 3.0–3.2: the harness exports a UTF-8 locale
	// before the tests (for 3.0–3.2 it first generates the locale, which
	// needs root: the environment must have en_US.UTF-8).
	hDjangoLocale1 = "LANG=en_US.UTF-8 LC_ALL=en_US.UTF-8 PYTHONIOENCODING=utf8 LANGUAGE=en_US:en "
	hDjangoLocale3 = "LANG=en_US.UTF-8 LANGUAGE=en_US:en LC_ALL=en_US.UTF-8 "
)

// Sphinx: the harness runs `tox --current-env -epy39 -v -- DIRECTIVES`
// after `sed -i 's/pytest/pytest -rA/' tox.ini`, that is tox.ini's
// [testenv] command with -rA after "pytest" and the directives as
// {posargs}, under its setenv, in the current environment (a tox plugin we
// cannot count on). We run that command directly, with the PYTHONWARNINGS
// it sets (from 6.2 on "error", which can fail a test), as sphinx's tox.ini
// had them at each X.Y.0 release (an instance from late in a development
// cycle may predate a change). Left out: tox's PYTEST_ADDOPTS=--color yes
// (from 3.3; colour codes only, which the pytest-v2 parser strips anyway),
// its random PYTHONHASHSEED and its trimmed environment, and, for 1.5 and
// 1.6, the documentation build tox ran after the tests.
const (
	hSphinxWarnings17 = "all,ignore::ImportWarning:pkgutil,ignore::ImportWarning:importlib._bootstrap,ignore::ImportWarning:importlib._bootstrap_external,ignore::ImportWarning:pytest_cov.plugin,ignore::DeprecationWarning:site,ignore::DeprecationWarning:_pytest.assertion.rewrite,ignore::DeprecationWarning:_pytest.fixtures,ignore::DeprecationWarning:distutils"
	hSphinxWarnings30 = "all,ignore::ImportWarning:importlib._bootstrap_external,ignore::DeprecationWarning:site,ignore::DeprecationWarning:distutils"
	hSphinxWarnings35 = hSphinxWarnings30 + ",ignore::DeprecationWarning:pip._vendor.packaging.version"

	hSphinx15 = "python3 -Wall tests/run.py -I py35 -m '^[tT]est'" // nose, through tests/run.py
	hSphinx16 = "python3 -Wall tests/run.py --ignore tests/py35"   // pytest without -rA, through tests/run.py
	hSphinx17 = "PYTHONWARNINGS='" + hSphinxWarnings17 + "' pytest -rA -Wall --durations 25"
	hSphinx20 = "PYTHONWARNINGS='" + hSphinxWarnings17 + "' pytest -rA --durations 25"
	hSphinx30 = "PYTHONWARNINGS='" + hSphinxWarnings30 + "' pytest -rA --durations 25"
	hSphinx34 = "PYTHONWARNINGS='" + hSphinxWarnings30 + "' python3 -X dev -m pytest -rA --durations 25"
	hSphinx35 = "PYTHONWARNINGS='" + hSphinxWarnings35 + "' python3 -X dev -m pytest -rA --durations 25"
	hSphinx44 = "PYTHONWARNINGS=all python3 -X dev -m pytest -rA --durations 25"
	hSphinx50 = "PYTHONWARNINGS=all python3 -X dev -X warn_default_encoding -m pytest -rA --durations 25"
	hSphinx62 = "PYTHONWARNINGS=error python3 -X dev -X warn_default_encoding -m pytest -rA --durations 25"
)

// harnessRepos is SWE-bench's table for its Python repositories (SWE-bench,
// Lite, Verified and the Lite dev split), keyed by OWNER/NAME. Versions not
// in byVersion use cmd. The harness's table also names dbt-labs/dbt-core,
// with no test command and no parser, and swe-bench/humaneval, with no
// parser: neither can be graded, so both are left to the default.
var harnessRepos = map[string]harnessRepo{
	"astropy/astropy": {cmd: hPytest, parser: "pytest-v2",
		byVersion: versions(hAstropyOld, "0.1", "0.2", "0.3", "0.4", "1.1", "1.2", "1.3")},
	"django/django": {cmd: hDjango, parser: "django", byVersion: merge(
		versions(hDjangoLocale1+hDjango, "1.7", "1.8", "1.10", "1.11", "2.0", "2.1", "2.2"),
		versions(hDjangoLocale1+hDjangoSerial, "1.9"),
		versions(hDjangoLocale3+hDjango, "3.0", "3.1", "3.2"),
		// 1.4–1.6 and 4.0 on: cmd, no locale.
	)},
	"matplotlib/matplotlib":        {cmd: hPytest, parser: "pytest-matplotlib"},
	"mwaskom/seaborn":              {cmd: hSeaborn, parser: "pytest-seaborn"},
	"pallets/flask":                {cmd: hPytest, parser: "pytest"},
	"psf/requests":                 {cmd: hPytest, parser: "pytest-options"},
	"pydata/xarray":                {cmd: hPytest, parser: "pytest"},
	"pylint-dev/pylint":            {cmd: hPytest, parser: "pytest-options"},
	"pytest-dev/pytest":            {cmd: hPytest, parser: "pytest"},
	"scikit-learn/scikit-learn":    {cmd: hPytest, parser: "pytest-v2"},
	"sympy/sympy":                  {cmd: hSympy, parser: "sympy"},
	"sqlfluff/sqlfluff":            {cmd: hPytest, parser: "pytest"},
	"marshmallow-code/marshmallow": {cmd: hPytest, parser: "pytest"},
	"pvlib/pvlib-python":           {cmd: hPytest, parser: "pytest"},
	"pydicom/pydicom":              {cmd: hPytest, parser: "pytest-options"},
	"pylint-dev/astroid":           {cmd: hPytest, parser: "pytest"},
	"pyvista/pyvista":              {cmd: hPytest, parser: "pytest"},
	"sphinx-doc/sphinx": {cmd: hSphinx62, parser: "pytest-v2", byVersion: merge(
		versions(hSphinx15, "1.5"),
		versions(hSphinx16, "1.6"),
		versions(hSphinx17, "1.7", "1.8"),
		versions(hSphinx20, "2.0", "2.1", "2.2", "2.3", "2.4"),
		versions(hSphinx30, "3.0", "3.1", "3.2", "3.3"),
		versions(hSphinx34, "3.4"),
		versions(hSphinx35, "3.5", "4.0", "4.1", "4.2", "4.3"),
		versions(hSphinx44, "4.4", "4.5"),
		versions(hSphinx50, "5.0", "5.1", "5.2", "5.3", "6.0", "6.1"),
		// 6.2 on: cmd.
	)},
}

// versions maps each of vs to cmd.
func versions(cmd string, vs ...string) map[string]string {
	m := make(map[string]string, len(vs))
	for _, v := range vs {
		m[v] = cmd
	}
	return m
}

func merge(ms ...map[string]string) map[string]string {
	out := map[string]string{}
	for _, m := range ms {
		for k, v := range m {
			out[k] = v
		}
	}
	return out
}

// HarnessParser is the parser (a key of Parsers) for one of the harness's
// Python log parsers by its name, as SWE-bench 5's datasets give it in an
// instance's log_parser field ("parse_log_django", say).
func HarnessParser(logParser string) (string, bool) {
	p, ok := harnessLogParsers[logParser]
	return p, ok
}

var harnessLogParsers = map[string]string{
	"parse_log_pytest":         "pytest",
	"parse_log_astroid":        "pytest",
	"parse_log_flask":          "pytest",
	"parse_log_marshmallow":    "pytest",
	"parse_log_pvlib":          "pytest",
	"parse_log_pyvista":        "pytest",
	"parse_log_sqlfluff":       "pytest",
	"parse_log_xarray":         "pytest",
	"parse_log_pytest_options": "pytest-options",
	"parse_log_pydicom":        "pytest-options",
	"parse_log_requests":       "pytest-options",
	"parse_log_pylint":         "pytest-options",
	"parse_log_pytest_v2":      "pytest-v2",
	"parse_log_astropy":        "pytest-v2",
	"parse_log_scikit":         "pytest-v2",
	"parse_log_sphinx":         "pytest-v2",
	"parse_log_matplotlib":     "pytest-matplotlib",
	"parse_log_seaborn":        "pytest-seaborn",
	"parse_log_django":         "django",
	"parse_log_sympy":          "sympy",
}
