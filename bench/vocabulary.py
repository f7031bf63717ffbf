"""Words, names and legacy-charset texts the benchmarks build realistic mail from
(shared by ingest.py and daemon_backfill.py)."""

from email.charset import BASE64, QP

_WORDS = (
    "the order invoice shipment delivery account password reset please thanks hello "
    "we you our your team support ticket issue problem question answer update today "
    "tomorrow week month payment refund credit card bank transfer received sent attached "
    "document report contract renewal subscription plan upgrade downgrade cancel confirm "
    "meeting call schedule available time zone morning afternoon evening office remote "
    "customer product feature request bug error crash login server database backup "
    "restore migration release version notes change log review approve reject escalate "
    "priority urgent normal low high status pending resolved closed open reopened "
    "warehouse pallet carrier tracking number address street city country postal code "
    "price quote discount tax total amount due overdue reminder statement balance "
    "could would should will can may might must need want like know think see look "
    "find give take make get send call write read check confirm follow forward reply "
    "about after again also always because before below between both during each few "
    "from into just more most much never now only other over same some such than then "
    "there these they this those through under until very what when where which while "
    "who why with without yes no not and but or if so as at by for in of on to up"
).split()
_FIRST = (
    "anna ben carla david emma felix greta hans ines jonas karin lars maria nina "
    "oskar paula quentin rosa stefan tina ulrich vera walter xenia yusuf zoe "
    "li wei sofia mateo chloe noah amelia liam olivia lucas mia ethan"
).split()
_LAST = (
    "miller schmidt garcia rossi dubois novak kowalski jensen silva tanaka kim "
    "nguyen patel smith brown wilson taylor anderson thomas moore martin lee "
    "walker young king wright scott green baker adams nelson hill"
).split()
_DOMAINS = (
    "gmail.com outlook.com yahoo.co.uk example.org contoso.example "
    "fabrikam.example northwind.example globex.example initech.example "
    "umbrella.example hooli.example stark-industries.example"
).split()

_LEGACY = {
    # charset: (text with characters only that charset has, body encoding)
    "iso-8859-1": (
        "Grüße aus München! Die Bestellung für Herrn Müller ist unterwegs; "
        "la façade de l'hôtel à Genève est rénovée. Señor Núñez, ¿qué tal?",
        QP,
    ),
    "windows-1252": (
        "Price: 49 € – “quoted” and ‘single’ marks… Œuvre, Šárka, "
        "dash — bullet • trademark ™ per‰.",
        QP,
    ),
    "iso-2022-jp": (
        "お問い合わせありがとうございます。ご注文の商品は明日発送いたします。"
        "請求書を添付しましたのでご確認ください。",
        None,
    ),
    "koi8-r": (
        "Здравствуйте! Ваш заказ отправлен сегодня. Счёт приложен к письму, "
        "пожалуйста, проверьте реквизиты и подтвердите оплату.",
        BASE64,
    ),
}


# display-name additions in each header charset (RFC 2047 encoded words)
_NAME_SUFFIX = {
    "utf-8": "",
    "iso-8859-1": "Müller",
    "windows-1252": "Šárka",
    "iso-2022-jp": "山田",
    "koi8-r": "Иванов",
}
