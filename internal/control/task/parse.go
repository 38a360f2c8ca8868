package task

import (
	"regexp"
	"sort"
	"strings"
	"unicode"
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
	// pytest: `pytest -rA`, read as SWE-bench's harness reads it (its
	// parse_log_pytest): a line that starts with PASSED, FAILED, ERROR,
	// SKIPPED or XFAIL names the test in its next word ("PASSED path::name",
	// "FAILED path::name - why"); "SKIPPED [N] path:line: why" names none.
	// XFAIL passes and XPASS is not read (the test counts as missing), as
	// the harness grades them.
	"pytest": parsePytest,
	// pytest-options: pytest, with the harness's normalisation of
	// parametrised names (parse_log_pytest_options): name[/abs/path/file]
	// becomes name[/file], and anything after the last "]" is dropped
	// (requests, pylint, pydicom).
	"pytest-options": parsePytestOptions,
	// pytest-v2: the harness's parse_log_pytest_v2 (astropy, scikit-learn,
	// sphinx): colour codes and control characters removed; "STATUS name"
	// where the name runs to the line's end (spaces kept, a FAILED line's
	// " - why" cut), and "name STATUS" lines of older and verbose pytest;
	// plus, for a name cut at a space inside its brackets, as the
	// datasets' lists hold it, the outcome the harness's grading gives it.
	"pytest-v2": parsePytestV2,
	// pytest-matplotlib: pytest, with MouseButton.LEFT and .RIGHT read as
	// 1 and 3 in names (parse_log_matplotlib).
	"pytest-matplotlib": parsePytestMatplotlib,
	// pytest-seaborn: the harness's parse_log_seaborn: only PASSED and
	// FAILED lines ("STATUS name" or "name PASSED ..."); a skipped, xfailed
	// or erroring test counts as missing.
	"pytest-seaborn": parsePytestSeaborn,
	// django: Django's `runtests.py --verbosity 2`, as the harness reads it
	// (parse_log_django): the name is the text before " ... " (a test with
	// a docstring is named by the docstring's first line, which Django
	// prints on its own line after "test_x (mod.Class)"); ok, skipped,
	// FAIL, ERROR; "expected failure" and "unexpected success" count as
	// missing; an "ok" on a later line passes the last test named.
	"django": parseDjango,
	// sympy: sympy's `bin/test --verbose` (parse_log_sympy): "test_x ok",
	// "test_x F", "test_x E", named by the function only; skips, xfails and
	// xpasses count as missing, and so does each file's last test (its
	// line ends in "[OK]"); failure headers "___ path.py:test_x ___" name
	// path.py:test_x failed.
	"sympy": parseSympy,
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

// The parsers below read test output as SWE-bench's evaluation harness
// reads it (its log parsers, as of SWE-bench 5.0.2), so that an episode is
// graded as the harness grades it; names are kept exactly as the harness
// forms them, since the datasets' FAIL_TO_PASS and PASS_TO_PASS lists were
// made with them. The harness's statuses map to outcomes as its grading
// counts them: PASSED and XFAIL pass, SKIPPED is skipped (which a
// PASS_TO_PASS test may be and a FAIL_TO_PASS test may not), FAILED and
// ERROR fail. What the harness does not read (XPASS, for one) is left out:
// the test counts as missing, which fails it, as in the harness. Where the
// harness lets a later line overwrite a test's status, a test here keeps
// its worst outcome (record).

// harnessOutcome is the outcome of one of the harness's pytest statuses.
func harnessOutcome(status string) (string, bool) {
	switch status {
	case "PASSED", "XFAIL":
		return Passed, true
	case "SKIPPED":
		return Skipped, true
	case "FAILED", "ERROR":
		return Failed, true
	}
	return "", false
}

var harnessStatuses = []string{"FAILED", "PASSED", "SKIPPED", "ERROR", "XFAIL"}

// pyStatusPrefix says whether l starts with one of the harness's statuses.
func pyStatusPrefix(l string) bool {
	for _, s := range harnessStatuses {
		if strings.HasPrefix(l, s) {
			return true
		}
	}
	return false
}

func pyStatusSuffix(l string) bool {
	for _, s := range harnessStatuses {
		if strings.HasSuffix(l, s) {
			return true
		}
	}
	return false
}

// isPySpace is Python's str.isspace for one character: Go's unicode.IsSpace
// and the four ASCII separators 0x1c-0x1f.
func isPySpace(r rune) bool {
	return unicode.IsSpace(r) || (r >= 0x1c && r <= 0x1f)
}

// pyFields splits s as Python's str.split() does.
func pyFields(s string) []string { return strings.FieldsFunc(s, isPySpace) }

// pyStrip trims s as Python's str.strip() does.
func pyStrip(s string) string { return strings.TrimFunc(s, isPySpace) }

var skipSummaryRE = regexp.MustCompile(`^\[\d+\]$`)

// isSkipSummary: "SKIPPED [N] path:line: why" is a count of skipped tests,
// not a test.
func isSkipSummary(status, name string) bool {
	return status == "SKIPPED" && skipSummaryRE.MatchString(name)
}

// pytestFirstWord reads a "STATUS name ..." line as the harness's pytest
// parsers do: the name is the word after the status.
func pytestFirstWord(l string) (status, name string, ok bool) {
	if !pyStatusPrefix(l) {
		return "", "", false
	}
	if strings.HasPrefix(l, "FAILED") {
		l = strings.ReplaceAll(l, " - ", " ")
	}
	f := pyFields(l)
	if len(f) < 2 || isSkipSummary(f[0], f[1]) {
		return "", "", false
	}
	return f[0], f[1], true
}

// parsePytestLines is the harness's pytest parser with its per-repository
// touches: fix rewrites each line first, rename each name.
func parsePytestLines(out string, fix, rename func(string) string) map[string]string {
	m := map[string]string{}
	for _, l := range strings.Split(out, "\n") {
		if fix != nil {
			l = fix(l)
		}
		status, name, ok := pytestFirstWord(l)
		if !ok {
			continue
		}
		o, ok := harnessOutcome(status)
		if !ok {
			continue
		}
		if rename != nil {
			name = rename(name)
		}
		record(m, name, o)
	}
	return m
}

func parsePytest(out string) map[string]string { return parsePytestLines(out, nil, nil) }

func parsePytestOptions(out string) map[string]string {
	return parsePytestLines(out, nil, optionName)
}

// optionName shortens a parameter that is an absolute path to its last
// element (a temporary directory differs from run to run) and drops what
// follows the last "]".
func optionName(name string) string {
	i := strings.Index(name, "[")
	j := strings.LastIndex(name, "]")
	if i < 0 || j < i {
		return name
	}
	opt := name[i+1 : j]
	if strings.HasPrefix(opt, "/") && !strings.HasPrefix(opt, "//") && !strings.Contains(opt, "*") {
		opt = "/" + opt[strings.LastIndex(opt, "/")+1:]
	}
	return name[:i] + "[" + opt + "]"
}

var mouseButtons = strings.NewReplacer("MouseButton.LEFT", "1", "MouseButton.RIGHT", "3")

func parsePytestMatplotlib(out string) map[string]string {
	return parsePytestLines(out, mouseButtons.Replace, nil)
}

func parsePytestSeaborn(out string) map[string]string {
	m := map[string]string{}
	for _, l := range strings.Split(out, "\n") {
		f := pyFields(l)
		if len(f) < 2 {
			continue
		}
		switch {
		case strings.HasPrefix(l, "FAILED"):
			record(m, f[1], Failed)
		case strings.Contains(l, " PASSED "):
			if f[1] == "PASSED" {
				record(m, f[0], Passed)
			}
		case strings.HasPrefix(l, "PASSED"):
			record(m, f[1], Passed)
		}
	}
	return m
}

// colourCodeRE is what the harness strips of an ANSI colour code (the
// escape character goes with the other control characters).
var colourCodeRE = regexp.MustCompile(`\[\d+m`)

func dropControls(r rune) rune {
	if r >= 1 && r < 32 {
		return -1
	}
	return r
}

func parsePytestV2(out string) map[string]string {
	m := map[string]string{}
	var order []string // the names in the order first seen
	add := func(name, status string) {
		o, ok := harnessOutcome(status)
		if !ok {
			return
		}
		name = strings.TrimSpace(name)
		if _, seen := m[name]; !seen && name != "" {
			order = append(order, name)
		}
		record(m, name, o)
	}
	for _, l := range strings.Split(out, "\n") {
		l = strings.Map(dropControls, colourCodeRE.ReplaceAllString(l, ""))
		if pyStatusPrefix(l) {
			if strings.HasPrefix(l, "FAILED") {
				l, _, _ = strings.Cut(l, " - ")
			}
			if f := pyFields(l); len(f) >= 2 && !isSkipSummary(f[0], f[1]) {
				add(strings.Join(f[1:], " "), f[0])
			}
		} else if pyStatusSuffix(l) {
			if f := pyFields(l); len(f) >= 2 {
				add(strings.Join(f[:len(f)-1], " "), f[len(f)-1])
			}
		}
	}
	for n, o := range truncatedNames(m, order) {
		m[n] = o
	}
	return m
}

// truncatedNames gives the outcomes of the names the datasets' lists hold
// for tests whose names have a space inside their brackets: the harness's
// older parsers cut a name at its first space ("t[a b]" was "t[a"). The
// harness's grading finds such a name, one with more "[" than "]" that is
// not itself in the output, by prefix: it takes the first test (in output
// order) whose name starts with it, provided all such tests agree on
// passing; otherwise the test counts as missing.
func truncatedNames(m map[string]string, order []string) map[string]string {
	out := map[string]string{}
	var sorted []string
	var at map[string]int
	done := map[string]bool{}
	for _, n := range order {
		cut, _, ok := strings.Cut(n, " ")
		if !ok || done[cut] || strings.Count(cut, "[") <= strings.Count(cut, "]") {
			continue
		}
		done[cut] = true
		if _, exact := m[cut]; exact {
			continue
		}
		if sorted == nil {
			sorted = append([]string(nil), order...)
			sort.Strings(sorted)
			at = make(map[string]int, len(order))
			for i, n := range order {
				at[n] = i
			}
		}
		first := ""
		passing, other := false, false
		for i := sort.SearchStrings(sorted, cut); i < len(sorted) && strings.HasPrefix(sorted[i], cut); i++ {
			c := sorted[i]
			if m[c] == Passed {
				passing = true
			} else {
				other = true
			}
			if first == "" || at[c] < at[first] {
				first = c
			}
		}
		if !(passing && other) {
			out[cut] = m[first]
		}
	}
	return out
}

const (
	// A test of Django's whose output the harness passes by name.
	djangoVersionTest = "--version is equivalent to version"
	// Migration output that runs into a test's line (django__django-7188).
	djangoMigrationLine = "Applying sites.0002_alter_domain_unique...test_no_migrations"
)

var djangoPassSuffixes = []string{" ... ok", " ... OK", " ...  OK"}

// djangoInterrupted: a test's line that a long message from Django cut,
// its "ok" on the next line; the harness passes the test by these three
// patterns. need is a piece of text each needs, to spare the search in
// output without it.
var djangoInterrupted = []struct {
	need string
	re   *regexp.Regexp
}{
	{"silenced).\nok", regexp.MustCompile(`(?m)^(.*?)\s\.\.\.\sTesting against Django installed in (?s:.*?) silenced\)\.\nok$`)},
	{"Internal Server Error: /", regexp.MustCompile(`(?m)^(.*?)\s\.\.\.\sInternal Server Error: /.*/\nok$`)},
	{"(0 silenced)\nok", regexp.MustCompile(`(?m)^(.*?)\s\.\.\.\sSystem check identified no issues \(0 silenced\)\nok$`)},
}

func parseDjango(out string) map[string]string {
	m := map[string]string{}
	last := "" // the last test named before " ... "
	for _, l := range strings.Split(out, "\n") {
		l = pyStrip(l)
		if strings.Contains(l, djangoVersionTest) {
			record(m, djangoVersionTest, Passed)
		}
		if before, _, ok := strings.Cut(l, " ... "); ok {
			last = before
		}
		for _, suf := range djangoPassSuffixes {
			if !strings.HasSuffix(l, suf) {
				continue
			}
			if strings.HasPrefix(l, djangoMigrationLine) {
				_, after, _ := strings.Cut(l, "...")
				l = pyStrip(after)
			}
			name := l
			if i := strings.LastIndex(l, suf); i >= 0 {
				name = l[:i]
			}
			record(m, name, Passed)
			break
		}
		if i := strings.Index(l, " ... skipped"); i >= 0 {
			record(m, l[:i], Skipped)
		}
		for _, s := range []string{" ... FAIL", " ... ERROR"} {
			if strings.HasSuffix(l, s) {
				record(m, l[:strings.Index(l, s)], Failed)
			}
		}
		// The traceback's header: "FAIL: test_x (mod.Class)" names
		// test_x alone.
		if strings.HasPrefix(l, "FAIL:") || strings.HasPrefix(l, "ERROR:") {
			if f := pyFields(l); len(f) > 1 {
				record(m, f[1], Failed)
			}
		}
		// A test that printed after " ... " gets its result on a later
		// line.
		if strings.HasPrefix(l, "ok") && last != "" {
			record(m, last, Passed)
		}
	}
	for _, p := range djangoInterrupted {
		if !strings.Contains(out, p.need) {
			continue
		}
		for _, g := range p.re.FindAllStringSubmatch(out, -1) {
			record(m, g[1], Passed)
		}
	}
	return m
}

// sympyHeaderRE is a failure's header, "____ path/test_x.py:test_y ____"
// (and whatever else has " X.py:Y " in it, as in the harness).
var sympyHeaderRE = regexp.MustCompile(`_* (.*)\.py:(.*) _*`)

func parseSympy(out string) map[string]string {
	m := map[string]string{}
	for _, g := range sympyHeaderRE.FindAllStringSubmatch(out, -1) {
		record(m, g[1]+".py:"+g[2], Failed)
	}
	for _, l := range strings.Split(out, "\n") {
		l = pyStrip(l)
		if !strings.HasPrefix(l, "test_") {
			continue
		}
		name := pyFields(l)[0]
		switch {
		case strings.HasSuffix(l, " E"), strings.HasSuffix(l, " F"):
			record(m, name, Failed)
		case strings.HasSuffix(l, " ok"):
			record(m, name, Passed)
		}
	}
	return m
}
