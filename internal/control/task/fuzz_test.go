package task

import (
	"strings"
	"testing"
)

// The test output parsers take whatever a test command printed: they must
// not panic, and they give only known outcomes to non-empty names.
func FuzzParsers(f *testing.F) {
	f.Add("--- PASS: TestA (0.00s)\n--- FAIL: TestB (0.01s)\n")
	f.Add("test_a (m.T.test_a) ... ok\ntest_b (m.T)\nDoc ... FAIL\nFAIL: test_c (m.T.test_c)\n")
	f.Add("PASSED a.py::t\nFAILED a.py::u - boom\n")
	f.Add("TAP version 13\nok 1 - a\nnot ok 2 - b # TODO\nok 3 # SKIP\n")
	f.Add("PASS: a\nFAIL: b\r\nSKIP: c\n")
	f.Fuzz(func(t *testing.T, out string) {
		for name, p := range Parsers {
			for test, o := range p(out) {
				if test == "" {
					t.Fatalf("%s: an empty test name", name)
				}
				if o != Passed && o != Failed && o != Skipped {
					t.Fatalf("%s: outcome %q", name, o)
				}
			}
		}
	})
}

// A task.json is user input: decoding must not panic, and what it accepts
// validates.
func FuzzParseDefinition(f *testing.F) {
	f.Add([]byte(`{"id":"a","statement":"s","test_cmd":"t","parser":"lines","fail_to_pass":["x"],"pass_to_pass":["y"],"budget_s":5}`))
	f.Add([]byte(`{"id":"a","statement":"s","test_cmd":"t","parser":"gotest","fail_to_pass":["x"],"env":{"K":"V"}}`))
	f.Add([]byte(`{"id":"../x"}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		tk, err := ParseDefinition(b)
		if err != nil {
			return
		}
		if err := tk.Validate(); err != nil {
			t.Fatalf("accepted a task that does not validate: %v", err)
		}
		_ = tk.Budget()
		_ = tk.ScriptMatch()
	})
}

// A SWE-bench line is user input: no panic, and an instance whose clone is
// absent is never loaded.
func FuzzInstance(f *testing.F) {
	f.Add([]byte(`{"instance_id":"a__b-1","repo":"a/b","base_commit":"abcdef1","problem_statement":"p","FAIL_TO_PASS":"[\"x\"]","PASS_TO_PASS":[]}`))
	f.Add([]byte(`{"instance_id":"a","FAIL_TO_PASS":"[1,2]"}`))
	f.Add([]byte(`{"instance_id":"a","repo":"../../etc","base_commit":"abcdef1"}`))
	repos := f.TempDir()
	f.Fuzz(func(t *testing.T, line []byte) {
		if tk, err := instanceTask(line, SWEBenchOptions{Repos: repos}); err == nil {
			t.Fatalf("loaded %s with no clone", tk.ID)
		}
	})
}

// checkParser runs one parser on out: no panic, the same answer twice, no
// empty name, only known outcomes, and, where within says so, every name
// is a piece of the output.
func checkParser(t *testing.T, parser, out string, within bool) {
	t.Helper()
	got := Parsers[parser](out)
	again := Parsers[parser](out)
	if len(got) != len(again) {
		t.Fatalf("%s: %d tests, then %d", parser, len(got), len(again))
	}
	for test, o := range got {
		if test == "" {
			t.Fatalf("%s: an empty test name", parser)
		}
		if o != Passed && o != Failed && o != Skipped {
			t.Fatalf("%s: %q: outcome %q", parser, test, o)
		}
		if again[test] != o {
			t.Fatalf("%s: %q: %s, then %s", parser, test, o, again[test])
		}
		if within && !strings.Contains(out, test) {
			t.Fatalf("%s: %q is not in the output", parser, test)
		}
	}
}

func FuzzDjangoParser(f *testing.F) {
	f.Add("test_a (m.tests.T) ... ok\ntest_b (m.tests.T)\nDoc line. ... FAIL\ntest_c (m.tests.T) ... skipped 'x'\ntest_d (m.tests.T) ... expected failure\n")
	f.Add("test_e (m.T.test_e) ... Internal Server Error: /x/\nok\nFAIL: test_b (m.tests.T)\nERROR: t\n")
	f.Add("Applying sites.0002_alter_domain_unique...test_no_migrations (m.T) ... ok\n--version is equivalent to version ... ok\r\n")
	f.Add("t ... Testing against Django installed in '/w' (0 silenced).\nok\nt2 ... System check identified no issues (0 silenced)\nok")
	f.Fuzz(func(t *testing.T, out string) { checkParser(t, "django", out, true) })
}

func FuzzSympyParser(f *testing.F) {
	f.Add("sympy/a/tests/test_b.py[3] \ntest_x ok\ntest_y F\ntest_z E      [FAIL]\n")
	f.Add("_____ sympy/a/tests/test_b.py:test_y _____\n  sympy/a/b.py:12: Warning \ntest_w f\ntest_v  - s\n")
	f.Fuzz(func(t *testing.T, out string) { checkParser(t, "sympy", out, true) })
}

func FuzzPytestOptionsParser(f *testing.F) {
	f.Add("PASSED t.py::a[/tmp/x/y.txt]\nFAILED t.py::b[//s/h] - no\nSKIPPED [1] t.py:3: why\nERROR t.py::c[a]b\n")
	f.Add("XFAIL t.py::d[/a*/b] - r\nPASSED t.py::e[/]\nPASSED t.py::f[]]\n")
	f.Fuzz(func(t *testing.T, out string) { checkParser(t, "pytest-options", out, false) })
}

func FuzzPytestV2Parser(f *testing.F) {
	f.Add("\x1b[32mPASSED\x1b[0m t.py::\x1b[1ma[x y]\x1b[0m\nFAILED t.py::a[x z] - boom\nt.py::b PASSED\nt.py::c[p q] XFAIL\n")
	f.Add("SKIPPED [2] t.py:1: r\nERROR t.py::d - e\nPASSED\tt.py::e\nPASSED t.py::f[1\nPASSED t.py::f[1 2]\n")
	f.Fuzz(func(t *testing.T, out string) { checkParser(t, "pytest-v2", out, false) })
}

func FuzzPytestMatplotlibParser(f *testing.F) {
	f.Add("PASSED t.py::z[MouseButton.LEFT]\nFAILED t.py::s[MouseButton.RIGHT-True] - x\nXFAIL t.py::p\n")
	f.Fuzz(func(t *testing.T, out string) { checkParser(t, "pytest-matplotlib", out, false) })
}

func FuzzPytestSeabornParser(f *testing.F) {
	f.Add("t.py::a PASSED [ 10%]\nPASSED t.py::b\nFAILED t.py::c - e\nSKIPPED [1] t.py:2: r\nXFAIL t.py::d\n")
	f.Fuzz(func(t *testing.T, out string) { checkParser(t, "pytest-seaborn", out, true) })
}

// A test patch is user input: deriving the harness's command from it must
// not panic, and a command it gives names only the patch's own files,
// shell-quoted.
func FuzzHarnessTest(f *testing.F) {
	f.Add("pallets/flask", "2.3", "diff --git a/tests/test_x.py b/tests/test_x.py\n--- a/tests/test_x.py\n+++ b/tests/test_x.py\n")
	f.Add("django/django", "4.0", "diff --git a/tests/admin/test_a.py b/tests/admin/test_a.py\n")
	f.Add("sympy/sympy", "1.1", "diff --git a/a b/sympy/core/tests/test_b.py\ndiff --git a/c.toml b/c.toml\n")
	f.Add("x/y", "", "diff --git a/a b/it's; rm -rf $HOME.py\n")
	f.Fuzz(func(t *testing.T, repo, version, patch string) {
		h, err := HarnessTest(repo, version, patch)
		if err != nil {
			return
		}
		if h.TestCmd == "" || h.Parser == "" || len(h.Files) == 0 {
			t.Fatalf("%+v", h)
		}
		if _, ok := Parsers[h.Parser]; !ok {
			t.Fatalf("parser %q", h.Parser)
		}
	})
}

// numstatPaths reads git's output: no panic on anything.
func FuzzNumstatPaths(f *testing.F) {
	f.Add("1\t0\ta.py\x002\t1\t\x00old.py\x00new.py\x00")
	f.Fuzz(func(t *testing.T, out string) {
		_ = numstatPaths(out)
	})
}
