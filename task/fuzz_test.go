package task

import (
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
		if tk, err := instanceTask(line, repos); err == nil {
			t.Fatalf("loaded %s with no clone", tk.ID)
		}
	})
}
