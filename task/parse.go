package task

import (
	"regexp"
	"sort"
	"strings"
)

// Outcomes of one test.
const (
	Passed  = "passed"
	Failed  = "failed"
	Skipped = "skipped"
	// Missing: the test did not appear in the output (it counts as not
	// passing).
	Missing = "missing"
)

// A Parser reads a test run's output and gives each test it names an
// outcome (Passed, Failed or Skipped). A test reported more than once keeps
// its worst outcome, so a failure is never hidden by a later pass.
type Parser func(output string) map[string]string

// Parsers are the test output formats a task can name.
var Parsers = map[string]Parser{
	// gotest: `go test -v`: "--- PASS: TestName (0.00s)", "--- FAIL: ...",
	// "--- SKIP: ..."; subtests are named Test/sub.
	"gotest": parseGoTest,
	// unittest: `python3 -m unittest -v`: "test_x (mod.Class.test_x) ... ok"
	// (Python 3.11 and later) or "test_x (mod.Class) ... ok" (earlier);
	// the name is mod.Class.test_x either way.
	"unittest": parseUnittest,
	// pytest: `pytest -rA`: "PASSED path::name", "FAILED path::name - why",
	// "ERROR path::name", "SKIPPED ...", "XFAIL ..." ; the name is path::name.
	"pytest": parsePytest,
	// tap: the Test Anything Protocol (`node --test --test-reporter=tap`):
	// "ok 1 - name", "not ok 2 - name", "ok 3 - name # SKIP", at any
	// indentation.
	"tap": parseTAP,
	// lines: one line per test, "PASS: name" or "FAIL: name" (or "SKIP:").
	"lines": parseLines,
}

// ParserNames lists the parsers, sorted.
func ParserNames() []string {
	var ns []string
	for n := range Parsers {
		ns = append(ns, n)
	}
	sort.Strings(ns)
	return ns
}

// rank orders outcomes from best to worst.
func rank(o string) int {
	switch o {
	case Passed:
		return 0
	case Skipped:
		return 1
	default:
		return 2
	}
}

func record(m map[string]string, name, outcome string) {
	name = strings.TrimSpace(name)
	if name == "" {
		return
	}
	if old, ok := m[name]; ok && rank(old) >= rank(outcome) {
		return
	}
	m[name] = outcome
}

var goTestRE = regexp.MustCompile(`^\s*--- (PASS|FAIL|SKIP): (\S+)`)

func parseGoTest(out string) map[string]string {
	m := map[string]string{}
	for _, l := range strings.Split(out, "\n") {
		if g := goTestRE.FindStringSubmatch(l); g != nil {
			record(m, g[2], map[string]string{"PASS": Passed, "FAIL": Failed, "SKIP": Skipped}[g[1]])
		}
	}
	return m
}

var (
	unittestRE     = regexp.MustCompile(`^(\w+) \(([\w.]+)\)(?:\s.*)? \.\.\. (.*)$`)
	unittestHeadRE = regexp.MustCompile(`^(\w+) \(([\w.]+)\)`)
)

func parseUnittest(out string) map[string]string {
	m := map[string]string{}
	var pending string // a test whose docstring line carries the result
	for _, l := range strings.Split(out, "\n") {
		l = strings.TrimRight(l, "\r")
		var name, res string
		if g := unittestRE.FindStringSubmatch(l); g != nil {
			name, res = unittestName(g[1], g[2]), strings.TrimSpace(g[3])
			pending = ""
		} else if g := unittestHeadRE.FindStringSubmatch(l); g != nil && len(g[0]) == len(l) {
			pending = unittestName(g[1], g[2])
			continue
		} else if before, after, ok := strings.Cut(l, " ... "); pending != "" && ok && before != "" {
			name, res = pending, strings.TrimSpace(after)
			pending = ""
		} else {
			continue
		}
		switch {
		case res == "ok":
			record(m, name, Passed)
		case strings.HasPrefix(res, "skipped"), res == "expected failure":
			record(m, name, Skipped)
		default: // FAIL, ERROR, unexpected success
			record(m, name, Failed)
		}
	}
	// A failure's traceback header names the test again:
	// "FAIL: test_x (mod.Class.test_x)".
	for _, l := range strings.Split(out, "\n") {
		for _, p := range []string{"FAIL: ", "ERROR: "} {
			if rest, ok := strings.CutPrefix(l, p); ok {
				if g := unittestHeadRE.FindStringSubmatch(rest); g != nil {
					name := g[2]
					if !strings.HasSuffix(name, "."+g[1]) {
						name += "." + g[1]
					}
					record(m, name, Failed)
				}
			}
		}
	}
	return m
}

// unittestName is mod.Class.method from the method and the parenthesised
// part, which holds mod.Class.method (3.11 and later) or mod.Class.
func unittestName(method, paren string) string {
	if strings.HasSuffix(paren, "."+method) {
		return paren
	}
	return paren + "." + method
}

var pytestRE = regexp.MustCompile(`^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+::\S+)`)

func parsePytest(out string) map[string]string {
	m := map[string]string{}
	for _, l := range strings.Split(out, "\n") {
		g := pytestRE.FindStringSubmatch(strings.TrimSpace(l))
		if g == nil {
			continue
		}
		switch g[1] {
		case "PASSED", "XPASS":
			record(m, g[2], Passed)
		case "SKIPPED", "XFAIL":
			record(m, g[2], Skipped)
		default:
			record(m, g[2], Failed)
		}
	}
	return m
}

var tapRE = regexp.MustCompile(`^\s*(ok|not ok)\b(?:\s+\d+)?(?:\s+-)?\s*(.*)$`)

func parseTAP(out string) map[string]string {
	m := map[string]string{}
	for _, l := range strings.Split(out, "\n") {
		g := tapRE.FindStringSubmatch(strings.TrimRight(l, "\r"))
		if g == nil {
			continue
		}
		name, directive, _ := strings.Cut(g[2], " # ")
		if strings.HasPrefix(g[2], "# ") {
			name, directive = "", g[2][2:]
		}
		d := strings.ToUpper(strings.TrimSpace(directive))
		switch {
		case strings.HasPrefix(d, "SKIP"):
			record(m, name, Skipped)
		case strings.HasPrefix(d, "TODO"):
			record(m, name, Skipped)
		case g[1] == "ok":
			record(m, name, Passed)
		default:
			record(m, name, Failed)
		}
	}
	return m
}

var linesRE = regexp.MustCompile(`^(PASS|FAIL|SKIP): (.+)$`)

func parseLines(out string) map[string]string {
	m := map[string]string{}
	for _, l := range strings.Split(out, "\n") {
		if g := linesRE.FindStringSubmatch(strings.TrimRight(l, "\r")); g != nil {
			record(m, g[2], map[string]string{"PASS": Passed, "FAIL": Failed, "SKIP": Skipped}[g[1]])
		}
	}
	return m
}
