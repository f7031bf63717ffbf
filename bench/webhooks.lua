-- wrk script for bench/webhooks.py: send the pre-signed requests of $BENCH_REQUESTS
-- in order, one per line: "Header: value" pairs joined by \1, then \2, then the body.
local requests = {}
local next_index = 1

function init(args)
  local path = os.getenv("BENCH_REQUESTS")
  for line in io.lines(path) do
    local head, body = line:match("^([^\2]*)\2(.*)$")
    local headers = {}
    for pair in head:gmatch("[^\1]+") do
      local name, value = pair:match("^([^:]+): (.*)$")
      headers[name] = value
    end
    requests[#requests + 1] = wrk.format("POST", nil, headers, body)
  end
end

function request()
  local r = requests[next_index]
  next_index = next_index + 1
  if next_index > #requests then next_index = 1 end
  return r
end
